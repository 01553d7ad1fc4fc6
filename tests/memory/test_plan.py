"""The memory plan (issue 29): predictions checked against real steps measured another way, and the
plan where users meet it (a Trainer's own data, `run.train`'s first micro-batch, nothing it plans
changed by planning).

The prediction traces one step on fake tensors (`colab_kit.memory.steptrace`); the measurement runs
the same step for real under PyTorch's profiler and replays its allocation events to a peak
(`tests/scripts/measured_peak.py`). Models are BERT- and GPT-2-shaped, built from configs. Attention
dropout is 0 in the measured models: the plan predicts a GPU's fused attention kernel, which never
holds the score matrix, where the CPU's math path (taken for attention dropout) would.
"""

import numpy as np
import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

import colab_kit as ck
from colab_kit.memory.plan import planned_micro_batch
from colab_kit.memory.recipes import checkpointing_requested, set_checkpointing
from colab_kit.memory.planrows import micro_batches, step_parts
from colab_kit.memory.steptrace import FakeStep
from measured_peak import measured_step_peak

VOCAB = 2000


def build(kind, checkpointing=False):
    torch.manual_seed(0)
    if kind == "bert":
        model = BertForSequenceClassification(BertConfig(
            vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512,
            max_position_embeddings=256, num_labels=2, attention_probs_dropout_prob=0.0))
    else:
        model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=256, n_embd=128, n_layer=2, n_head=2,
                                           attn_pdrop=0.0))
    if checkpointing:
        set_checkpointing(model)
    return model


def batch_for(kind, rows, seq):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (rows, seq), generator=generator)
    if kind == "bert":
        return {"input_ids": ids, "attention_mask": torch.ones(rows, seq, dtype=torch.long),
                "labels": torch.randint(0, 2, (rows,), generator=generator)}
    return {"input_ids": ids, "labels": ids.clone()}


def spec_of(batch):
    return {k: (tuple(v.shape), v.dtype) for k, v in batch.items()}


def predicted(kind, batch, precision, checkpointing):
    step = FakeStep(build(kind), None, round_to=1)  # the CPU allocator does not round
    trace = step.trace(spec_of(batch), precision=precision, checkpointing=checkpointing)
    return max(trace.peak, step.trace_optimizer_step().peak), trace


def measured(kind, batch, precision, checkpointing, micro_batches=1):
    def make():
        model = build(kind, checkpointing)
        return model, torch.optim.AdamW(model.parameters(), lr=5e-5, foreach=True)

    return measured_step_peak(make, batch, precision=precision, micro_batches=micro_batches)


CONFIGS = [(kind, seq, ckpt, precision) for kind in ("bert", "gpt2") for seq in (64, 128)
           for ckpt in (False, True) for precision in ("fp32", "bf16")]


@pytest.mark.parametrize("kind,seq,checkpointing,precision", CONFIGS)
def test_the_predicted_peak_is_within_ten_percent_of_a_measured_step(kind, seq, checkpointing, precision):
    batch = batch_for(kind, 8, seq)
    prediction, _ = predicted(kind, batch, precision, checkpointing)
    actual = measured(kind, batch, precision, checkpointing)
    error = (prediction - actual) / actual
    print(f"{kind} 8x{seq} checkpointing={checkpointing} {precision}: predicted {prediction:,} B, "
          f"measured {actual:,} B, {error:+.2%}")
    assert abs(error) <= 0.10


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_weights_gradients_and_optimizer_state_are_exact_to_the_byte(kind):
    step = FakeStep(build(kind), None, round_to=1)
    model = build(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
    model(**batch_for(kind, 2, 16)).loss.backward()
    gradients = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    optimizer.step()
    state = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values())  # step counts too
    weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    assert (step.weights, step.trainable, step.optimizer_state) == (weights, gradients, state)
    trace = step.trace(spec_of(batch_for(kind, 2, 16)))
    assert trace.gradients == gradients and trace.parts["weights"] == weights
    assert trace.parts["optimizer"] == state  # resident through the step, as from the second step on


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_a_planned_micro_batch_is_within_ten_percent_of_a_measured_accumulation(kind):
    """The plan's rule for a micro-batch (`planrows.step_parts`: every gradient, the activations at the traced
    peak scaled by its share) against two micro-batches of 4 measured as they accumulate."""
    batch = batch_for(kind, 8, 128)
    step = FakeStep(build(kind), None, round_to=1)
    trace = step.trace(spec_of(batch))
    parts = step_parts(trace, step, step.trace_optimizer_step(), 0, share=4 / 8, k=2)
    actual = measured(kind, batch, "fp32", False, micro_batches=2)
    print(f"{kind}: micro-batches of 4 predicted {sum(parts.values()):,} B, measured {actual:,} B")
    assert abs(sum(parts.values()) - actual) / actual <= 0.10


def test_frozen_layers_take_no_gradient_and_no_optimizer_state():
    from colab_kit.memory.recipes import freeze_layers

    whole, frozen = FakeStep(build("gpt2"), None, round_to=1), FakeStep(build("gpt2"), None, round_to=1, freeze=1)
    reference = build("gpt2")
    freeze_layers(reference, 1)
    frozen_bytes = sum(p.numel() * p.element_size() for p in reference.parameters() if not p.requires_grad)
    assert frozen.weights == whole.weights and whole.trainable - frozen.trainable == frozen_bytes > 0
    assert frozen.optimizer_state < whole.optimizer_state
    model = build("gpt2")
    freeze_layers(model, 1)  # a model the user froze: planned as it is (the tracker cannot hook a frozen weight)
    plan = ck.plan_memory(model, batch=batch_for("gpt2", 4, 64), gpu="T4", verbose=False, freeze=None)
    assert plan.chosen is not None and all(not p.requires_grad for p in model.get_input_embeddings().parameters())


def test_micro_batches_halve_down_to_one_row():
    assert micro_batches(32) == [32, 16, 8, 4, 2, 1]
    assert micro_batches(12) == [12, 6, 3, 2, 1]
    assert micro_batches(1) == [1]


def test_a_plan_names_what_fits_and_what_to_use_and_leaves_the_model_alone(capsys):
    model = build("gpt2")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = ck.plan_memory(model, batch=batch_for("gpt2", 8, 128), gpu="T4")
    text = capsys.readouterr().out
    assert "memory plan: GPT2LMHeadModel, per-device batch 8 x 128 tokens, on T4" in text
    assert {r.precision for r in plan.rows} == {"fp32", "fp16"}  # a T4 has no bf16
    assert {r.checkpointing for r in plan.rows} == {False, True}
    assert plan.chosen is not None and plan.chosen.fits and "<- use" in text
    assert all(r.peak == sum(r.parts.values()) for r in plan.rows)
    assert not checkpointing_requested(model) and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_nothing_fits_says_what_to_change():
    plan = ck.plan_memory(build("bert"), batch=batch_for("bert", 8, 64), gpu=350 << 20, verbose=False)
    assert plan.chosen is None and plan.micro_batch is None
    assert "nothing fits" in plan.advice() and "max_length" in plan.advice()


def test_a_bad_gpu_or_margin_is_refused_with_what_to_give():
    with pytest.raises(ValueError, match="'T4', 'L4', 'A100-40GB', 'auto'"):
        ck.plan_memory(build("bert"), batch=batch_for("bert", 2, 8), gpu="V100")
    with pytest.raises(ValueError, match="margin"):
        ck.plan_memory(build("bert"), batch=batch_for("bert", 2, 8), margin=0.9)
    with pytest.raises(ValueError, match="batch="):
        ck.plan_memory(build("bert"))


# -- a Trainer's plan: its data, its random state, and run.train's first micro-batch -----------------------------

def trainer_with(run_or_dir, **extra):
    from test_oom_trainer import trainer_for

    return trainer_for(run_or_dir, "bert", **extra)


def test_a_trainers_plan_reads_its_data_and_changes_no_random_state(local):
    trainer = trainer_with(local)
    lengths = [len(r["input_ids"]) for r in trainer.train_dataset.rows]
    states = torch.get_rng_state(), np.random.get_state()[1].copy()
    plan = ck.plan_memory(trainer, gpu="T4", verbose=False)
    assert torch.equal(torch.get_rng_state(), states[0]) and (np.random.get_state()[1] == states[1]).all()
    assert plan.seq_len == max(lengths) and plan.batch == 32
    assert f"the longest of {len(lengths)} sequences" in plan.lengths_note
    assert {r.optimizer for r in plan.rows} == {str(trainer.args.optim.value), "adafactor"}


def test_the_planned_micro_batch_avoids_the_out_of_memory_a_run_without_a_plan_meets(drive, local, capsys):
    """The OOM tests' fake GPU runs out of memory above 8 rows a micro-batch; the plan is made for a GPU
    whose memory lies between its own predictions for micro-batches of 8 and 16."""
    from test_oom_trainer import inject, oom_events

    wide = ck.plan_memory(trainer_with(local), gpu=2**34, verbose=False)
    peaks = {r.micro_batch: r.peak for r in wide.rows if r.current or (
        r.precision == "fp32" and not r.checkpointing and r.optimizer == wide.rows[0].optimizer)}
    assert peaks[8] < peaks[16]

    unplanned = ck.start_run("unplanned", drive=drive, local_dir=local / "a", save_every=None, quiet=True)
    trainer = trainer_with(unplanned)
    inject(trainer.model, "forward")
    unplanned.train(trainer)
    assert [(e["micro_from"], e["micro_to"]) for e in oom_events(unplanned)] == [(32, 16), (16, 8)]

    planned = ck.start_run("planned", drive=drive, local_dir=local / "b", save_every=None, quiet=True)
    trainer = trainer_with(planned)
    plan = ck.plan_memory(trainer, gpu=int((peaks[8] + peaks[16]) / 2 / 0.9), verbose=False)
    assert planned_micro_batch(trainer)[0] == 8
    inject(trainer.model, "forward")
    capsys.readouterr()
    planned.train(trainer)
    assert oom_events(planned) == [] and trainer.state.global_step == 12
    assert "training starts with micro-batches of 8: the memory plan's" in capsys.readouterr().out
    assert plan.for_configuration("fp32", False).micro_batch == 8


def test_planning_with_checkpointing_calls_nothing_deprecated_in_transformers(tmp_path, monkeypatch):
    """Issue 38, finding 7: no FutureWarning from the kit's own calls (transformers 5 renamed gradient to activation
    checkpointing), and advice in the installed version's words. `warnings.warn` itself is watched: the plan's
    trace silences warnings, which would hide a deprecated call there from `-W error`."""
    import os
    import traceback
    import warnings

    from transformers import TrainingArguments

    from colab_kit.memory.recipes import checkpointing_arg

    kit, ours, warn = os.path.dirname(ck.__file__) + os.sep, [], warnings.warn

    def watched(message, category=None, stacklevel=1, *args, **kwargs):
        if isinstance(category, type) and issubclass(category, FutureWarning) or isinstance(message, FutureWarning):
            frames = [f for f in traceback.extract_stack()[:-1] if "site-packages" not in f.filename]
            if frames and frames[-1].filename.startswith(kit):  # the nearest caller outside libraries is the kit
                ours.append(f"{frames[-1].filename[len(kit):]}:{frames[-1].lineno}: {message}")
        return warn(message, category, stacklevel + 1, *args, **kwargs)

    monkeypatch.setattr(warnings, "warn", watched)
    model = build("gpt2", checkpointing=True)
    args = TrainingArguments(str(tmp_path), report_to=[], max_steps=3, per_device_train_batch_size=4,
                             **ck.memory_args(gradient_checkpointing=True, group_by_length=False))
    plan = ck.plan_memory(model, args, batch=batch_for("gpt2", 4, 32), gpu="T4", verbose=False)
    assert {r.checkpointing for r in plan.rows} == {False, True}  # the checkpointed trace ran
    ck.preflight(model, args, verbose=False)
    set_checkpointing(model, False)
    assert ours == [], "\n".join(ours)
    advice = plan.advice()
    assert "gradient_checkpointing" not in advice or checkpointing_arg() == "gradient_checkpointing"


def test_checkpointing_is_named_as_the_installed_transformers_names_it():
    import transformers
    from packaging.version import Version

    from colab_kit.memory.recipes import checkpointing_arg

    installed = Version(transformers.__version__)
    if installed < Version("5"):
        assert (checkpointing_arg(), checkpointing_arg(kwargs=True)) == ("gradient_checkpointing",
                                                                        "gradient_checkpointing_kwargs")
    elif installed >= Version("5.24"):  # measured: 5.24 and 5.25 warn on the old name
        assert (checkpointing_arg(), checkpointing_arg(kwargs=True)) == ("activation_checkpointing",
                                                                        "activation_checkpointing_kwargs")
    else:
        assert checkpointing_arg() in ("gradient_checkpointing", "activation_checkpointing")
