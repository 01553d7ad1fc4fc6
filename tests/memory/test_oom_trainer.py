"""OOM recovery through run.train with the real HF Trainer (tiny BERT and GPT-2, CPU).

OOMs are injected: a hook raises torch.OutOfMemoryError whenever a micro-batch holds more than
8 samples, in the forward pass or in the backward pass (after the upper layers' gradients were
already accumulated). Dropout is 0: dropout masks depend on how a batch is split.
"""

import numpy as np
import pytest
import torch
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import colab_kit as ck
from colab_kit.checkpoints.journal import read_events
from colab_kit.memory.recipes import checkpointing_arg

LIMIT = 8


class RaggedData(torch.utils.data.Dataset):
    """Sequences of 4..24 tokens; label 1 when the motif 7-8-9 occurs (for the classifier)."""

    def __init__(self, n=160, seed=0, causal=False):
        rng = np.random.default_rng(seed)
        self.rows = []
        for _ in range(n):
            length = int(rng.integers(4, 25))
            ids = rng.integers(3, 30, size=length)
            label = int(rng.integers(0, 2))
            if label and length > 5:
                ids[2:5] = (7, 8, 9)
            self.rows.append({"input_ids": ids.tolist(), "label": label})
        self.causal = causal

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def pad_collate(causal):
    def collate(rows):
        length = max(len(r["input_ids"]) for r in rows)
        ids = torch.zeros(len(rows), length, dtype=torch.long)
        mask = torch.zeros(len(rows), length, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r["input_ids"])] = torch.tensor(r["input_ids"])
            mask[i, :len(r["input_ids"])] = 1
        labels = ids.masked_fill(mask == 0, -100) if causal else torch.tensor([r["label"] for r in rows])
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    return collate


def build_model(kind):
    torch.manual_seed(0)
    if kind == "bert":
        return BertForSequenceClassification(BertConfig(
            vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=32, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    if kind == "bert-mlm":
        return BertForMaskedLM(BertConfig(
            vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    return GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0))


def inject(model, where, limit=LIMIT, training_only=True):
    """Raise an OOM whenever a micro-batch holds more than `limit` samples."""
    embeddings = model.get_input_embeddings()

    def forward_hook(module, args, output):
        if output.shape[0] > limit and (module.training or not training_only):
            if where == "forward":
                raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {output.shape[0]} MiB")

            def in_backward(grad):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")

            output.register_hook(in_backward)  # fires after the layers above got their gradients

    return embeddings.register_forward_hook(forward_hook)


def trainer_for(run_or_dir, kind, *, batch=32, accum=1, steps=12, model=None, eval_data=None, **extra):
    out = run_or_dir.local_dir if hasattr(run_or_dir, "local_dir") else run_or_dir
    args = TrainingArguments(str(out), max_steps=steps, per_device_train_batch_size=batch,
                             gradient_accumulation_steps=accum, per_device_eval_batch_size=32,
                             learning_rate=5e-3, lr_scheduler_type="linear", warmup_steps=2, logging_steps=1,
                             save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0, **extra)
    token_labels = kind in ("gpt2", "bert-mlm")
    return Trainer(model=model or build_model(kind), args=args, train_dataset=RaggedData(causal=token_labels),
                   eval_dataset=eval_data, data_collator=pad_collate(token_labels))


def state(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def learning_rates(trainer):
    return [e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e]


def oom_events(run):
    return [e for e in read_events(run.drive_dir / "events.jsonl") if e["event"] == "oom"]


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_injected_oom_gives_the_same_training(drive, local, kind, where, capsys):
    ref_run = ck.start_run("ref", drive=drive, local_dir=local / "ref", save_every=None, quiet=True)
    reference = trainer_for(ref_run, kind)
    ref_out = ref_run.train(reference)

    run = ck.start_run("oom", drive=drive, local_dir=local / "oom", save_every=None, quiet=True)
    trainer = trainer_for(run, kind)
    inject(trainer.model, where)
    out = run.train(trainer)

    assert out.global_step == ref_out.global_step == 12
    assert learning_rates(trainer) == learning_rates(reference)
    assert max_diff(state(reference), state(trainer)) <= 1e-5
    events = oom_events(run)
    assert [(e["micro_from"], e["micro_to"]) for e in events] == [(32, 16), (16, 8)]
    assert {e["where"] for e in events} == {where} and events[0]["step"] == 1
    out_text = capsys.readouterr().out
    assert f"out of memory in {where} at step 1: micro-batch 32 -> 16" in out_text
    assert "2 out-of-memory back-off(s): training micro-batch 32 -> 8; the effective batch stayed 32" in out_text
    assert trainer.args.per_device_train_batch_size == 32 and trainer.args.gradient_accumulation_steps == 1


def test_gradient_accumulation_settings_give_the_same_effective_batch(drive, local):
    """per_device 8 x accumulation 4 is run as one batch of 32, split as memory allows."""
    a = ck.start_run("a", drive=drive, local_dir=local / "a", save_every=None, quiet=True)
    whole = trainer_for(a, "gpt2", batch=32, accum=1)
    a.train(whole)
    b = ck.start_run("b", drive=drive, local_dir=local / "b", save_every=None, quiet=True)
    accumulated = trainer_for(b, "gpt2", batch=8, accum=4)
    inject(accumulated.model, "forward")
    b.train(accumulated)
    assert max_diff(state(whole), state(accumulated)) <= 1e-5
    assert (accumulated.args.per_device_train_batch_size, accumulated.args.gradient_accumulation_steps) == (8, 4)


def test_without_an_oom_the_kit_trains_like_the_plain_trainer(drive, local, tmp_path):
    plain = trainer_for(tmp_path / "plain", "bert")
    plain.train()
    run = ck.start_run("kit", drive=drive, local_dir=local, save_every=None, quiet=True)
    kit = trainer_for(run, "bert")
    run.train(kit)
    assert max_diff(state(plain), state(kit)) <= 1e-6
    assert learning_rates(plain) == learning_rates(kit)


@pytest.mark.parametrize("kind", ["bert", "gpt2", "bert-mlm"])
def test_a_chosen_micro_batch_trains_like_the_whole_batch_on_less_padding(drive, local, kind):
    """Also a masked LM: its loss views the cut labels flat, which needs them contiguous."""
    ref_run = ck.start_run("whole", drive=drive, local_dir=local / "w", save_every=None, quiet=True)
    reference = trainer_for(ref_run, kind)
    ref_run.train(reference)
    run = ck.start_run("micro", drive=drive, local_dir=local / "m", save_every=None, quiet=True)
    trainer = trainer_for(run, kind)
    shapes = []
    trainer.model.get_input_embeddings().register_forward_hook(
        lambda module, args, output: shapes.append(tuple(output.shape[:2])) if module.training else None)
    run.train(trainer, micro_batch=8)
    assert max_diff(state(reference), state(trainer)) <= 1e-5
    assert learning_rates(reference) == learning_rates(trainer)
    assert len(shapes) == 4 * 12 and {rows for rows, _ in shapes} == {8}
    per_step = [shapes[i:i + 4] for i in range(0, len(shapes), 4)]
    assert all([length for _, length in step] == sorted(length for _, length in step) for step in per_step)
    assert sum(rows * length for rows, length in shapes) < 0.9 * 32 * sum(max(l for _, l in s) for s in per_step)
    assert oom_events(run) == [] and run.micro_batching.summary() is None


@pytest.mark.parametrize("bad", [0, -4, 2.5, True, "8"])
def test_a_bad_micro_batch_is_refused_before_training(drive, local, bad):
    run = ck.start_run("bad", drive=drive, local_dir=local, save_every=None, quiet=True)
    trainer = trainer_for(run, "bert", steps=2)
    with pytest.raises(ValueError, match="micro_batch=.*whole number of rows"):
        run.train(trainer, micro_batch=bad)
    with pytest.raises(ValueError, match="oom_recovery=True"):
        run.train(trainer, micro_batch=8, oom_recovery=False)
    assert trainer.state.global_step == 0
    run.train(trainer, micro_batch=4)  # the run is still open for the corrected call
    assert trainer.state.global_step == 2


def test_a_resumed_run_starts_with_the_learned_micro_batch(drive, local):
    class Crash(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 7:
                raise RuntimeError("runtime disconnected")

    run = ck.start_run("resume", drive=drive, local_dir=local, save_every=5, quiet=True)
    trainer = trainer_for(run, "bert")
    inject(trainer.model, "forward")
    trainer.add_callback(Crash())
    with pytest.raises(RuntimeError, match="disconnected"):
        run.train(trainer)
    assert len(oom_events(run)) == 2

    run = ck.start_run("resume", drive=drive, local_dir=local, save_every=5, quiet=True)
    assert run.resume_from.name == "checkpoint-5"
    trainer = trainer_for(run, "bert")
    inject(trainer.model, "forward")
    run.train(trainer)
    assert len(oom_events(run)) == 2  # no new back-off: the first step already used 8
    assert trainer.state.global_step == 12


def test_evaluation_oom_halves_the_evaluation_batch_only(drive, local):
    eval_data = RaggedData(n=64, seed=5)
    ref_run = ck.start_run("eref", drive=drive, local_dir=local / "r", save_every=None, quiet=True)
    reference = trainer_for(ref_run, "bert", eval_data=eval_data, eval_strategy="steps", eval_steps=6)
    ref_run.train(reference)
    run = ck.start_run("eval", drive=drive, local_dir=local / "e", save_every=None, quiet=True)
    trainer = trainer_for(run, "bert", eval_data=eval_data, eval_strategy="steps", eval_steps=6)
    inject(trainer.model, "forward", limit=4, training_only=False)
    trainer.model.get_input_embeddings()._forward_hooks.clear()
    embeddings = trainer.model.get_input_embeddings()

    def eval_only(module, args, output):
        if not module.training and output.shape[0] > 4:
            raise torch.OutOfMemoryError("CUDA out of memory during evaluation")

    embeddings.register_forward_hook(eval_only)
    run.train(trainer)
    evals = [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e]
    ref_evals = [e["eval_loss"] for e in reference.state.log_history if "eval_loss" in e]
    assert len(evals) == 2 and evals == pytest.approx(ref_evals, abs=1e-5)
    events = oom_events(run)
    assert [(e["where"], e["micro_from"], e["micro_to"]) for e in events] == [
        ("evaluation", 32, 16), ("evaluation", 16, 8), ("evaluation", 8, 4)]
    assert run.micro_batching.train.micro_batch is None  # training was never shrunk
    assert max_diff(state(reference), state(trainer)) <= 1e-5


def test_no_fit_even_at_one_sample_is_a_clear_error(drive, local):
    run = ck.start_run("tiny", drive=drive, local_dir=local, save_every=None, quiet=True)
    trainer = trainer_for(run, "gpt2")
    inject(trainer.model, "forward", limit=0)
    with pytest.raises(ck.OutOfMemoryError) as info:
        run.train(trainer)
    message = str(info.value)
    assert "even with a micro-batch of 1" in message and "fp16=True" in message
    assert f"{checkpointing_arg()}=True" in message and "Sequence length" in message
    assert ck.is_oom_error(info.value)
    assert [e["micro_to"] for e in oom_events(run)] == [16, 8, 4, 2, 1]


def test_oom_in_the_optimizer_step_is_reported_not_retried(drive, local):
    class HungryAdam(torch.optim.AdamW):
        def step(self, closure=None):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.20 GiB")

    run = ck.start_run("optim", drive=drive, local_dir=local, save_every=None, quiet=True)
    model = build_model("bert")
    trainer = trainer_for(run, "bert", model=model)
    trainer.optimizer = HungryAdam(model.parameters(), lr=1e-3)
    with pytest.raises(ck.OutOfMemoryError, match="optimizer step.*not retried.*adafactor"):
        run.train(trainer)
    assert [e["where"] for e in oom_events(run)] == ["optimizer step"]


def test_a_device_side_assert_is_not_retried_and_says_to_restart(drive, local):
    run = ck.start_run("assert", drive=drive, local_dir=local, save_every=None, quiet=True)
    trainer = trainer_for(run, "bert")

    def broken(module, args, output):
        raise RuntimeError("CUDA error: device-side assert triggered")

    trainer.model.get_input_embeddings().register_forward_hook(broken)
    with pytest.raises(RuntimeError, match="device-side assert") as info:
        run.train(trainer)
    assert any("Restart the runtime" in note for note in info.value.__notes__)
    assert oom_events(run) == []


def test_a_trainer_that_overrides_training_step_is_left_alone(drive, local, capsys):
    class Custom(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            return super().training_step(model, inputs, num_items_in_batch)

    run = ck.start_run("custom", drive=drive, local_dir=local, save_every=None, quiet=True)
    base = trainer_for(run, "bert", steps=2)
    trainer = Custom(model=base.model, args=base.args, train_dataset=base.train_dataset,
                     data_collator=base.data_collator)
    run.train(trainer)
    assert "out-of-memory recovery is off: this Trainer subclass overrides training_step" in capsys.readouterr().err
