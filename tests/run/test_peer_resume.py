"""The Hugging Face Trainer's own resume scenarios, through `ck.start_run` + `run.train` (issue 38, finding 5).

transformers tests resuming with models of every kind: plain `nn.Module`s with no `config` at all, with
`config = None`, and `PreTrainedModel`s; with gradient accumulation, frozen parameters, randomness in the
forward pass, a changed batch size, a training interrupted and resumed into a longer schedule, the order in
which batches are seen, and early stopping's saved state. Written here anew, in our own code, each with a
crash at a step the kit did not save (`StopAt`) and a resume on a new VM (only the run folder survives). A
model the kit has never seen cannot break `run.train` unnoticed again (`name_tied_copies` read
`model.config` and stopped every one of them before the first step).
"""

import math
import random
import shutil

import numpy as np
import pytest
import torch
from test_run import StopAt, max_diff, start, weights
from transformers import EarlyStoppingCallback, PretrainedConfig, PreTrainedModel, Trainer, TrainingArguments

import colab_kit as ck
from colab_kit.checkpoints.checkpoint import list_checkpoints


# -- data and models ----------------------------------------------------------------------------------------
class Points(torch.utils.data.Dataset):
    """y = 2x + 3 plus a little noise, one float each; from a generator of its own (the global RNGs untouched)."""

    def __init__(self, n=64, seed=42):
        rng = np.random.default_rng(seed)
        self.x = rng.normal(size=n).astype(np.float32)
        self.y = (2 * self.x + 3 + rng.normal(scale=0.1, size=n)).astype(np.float32)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_x": self.x[i], "labels": self.y[i]}


def _line(module, input_x, labels):
    y = input_x * module.a + module.b
    noise = getattr(module, "noise", False)
    if noise:  # every RNG the Trainer saves and restores: torch's, numpy's and Python's
        y = y + 0.05 * torch.randn_like(y) + 0.05 * (float(np.random.rand()) + random.random())
    return (y,) if labels is None else (torch.nn.functional.mse_loss(y, labels), y)


class Line(torch.nn.Module):
    """Two scalar parameters and no `config` attribute at all."""

    def __init__(self, a=0.0, b=0.0, noise=False):
        super().__init__()
        self.a, self.b = torch.nn.Parameter(torch.tensor(a)), torch.nn.Parameter(torch.tensor(b))
        self.noise = noise

    def forward(self, input_x, labels=None):
        return _line(self, input_x, labels)


class LineConfigNone(Line):
    """The same, with `config = None` (as transformers' own test model has it)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.config = None


class LineConfig(PretrainedConfig):
    model_type = "colab-kit-line"

    def __init__(self, a=0.0, b=0.0, noise=False, **kwargs):
        super().__init__(**kwargs)
        self.a, self.b, self.noise = a, b, noise


class LinePretrained(PreTrainedModel):
    """The same line as a `PreTrainedModel` with a config of its own."""

    config_class = LineConfig
    base_model_prefix = "line"

    def __init__(self, config):
        super().__init__(config)
        self.a, self.b = torch.nn.Parameter(torch.tensor(config.a)), torch.nn.Parameter(torch.tensor(config.b))
        self.noise = config.noise
        self.post_init()

    def _init_weights(self, module):  # the values come from the config
        pass

    def forward(self, input_x, labels=None):
        return _line(self, input_x, labels)


MODELS = {"no-config": lambda **kw: Line(**kw), "config-none": lambda **kw: LineConfigNone(**kw),
          "pretrained": lambda **kw: LinePretrained(LineConfig(**kw))}


def line_trainer(run, model, data=None, eval_data=None, **args):
    settings = dict(per_device_train_batch_size=8, num_train_epochs=3, learning_rate=0.1, logging_steps=5,
                    report_to=[], use_cpu=True, disable_tqdm=True, seed=42, save_strategy="no") | args
    callbacks = settings.pop("callbacks", None)
    return Trainer(model=model, args=TrainingArguments(str(run.local_dir), **settings),
                   train_dataset=data or Points(), eval_dataset=eval_data, callbacks=callbacks)


def trained(drive, local, name, make, *, crash_at=None, save_every=5, **args):
    """A run of `make(run)`, crashed at step `crash_at` (on a VM that then goes away), then resumed to its end.
    Returns (the trainer that finished, the step it resumed from, or None)."""
    resumed = None
    if crash_at is not None:
        run = start(drive, local, name, save_every=save_every, quiet=True, gauges=False)
        trainer = make(run, callbacks=[StopAt(crash_at)], **args)
        with pytest.raises(RuntimeError, match="simulated crash"):
            run.train(trainer)
        shutil.rmtree(local / name)  # a new VM: only the run folder survives
    run = start(drive, local, name, save_every=save_every, quiet=True, gauges=False)
    if crash_at is not None:
        assert run.resume_manifest is not None
        resumed = run.resume_manifest.step
    trainer = make(run, **args)
    run.train(trainer)
    run.finish(timeout=30)
    return trainer, resumed


def same_history(a, b) -> None:
    """The trainer states agree: step, epoch, and every logged loss and learning rate."""
    assert (a.state.global_step, a.state.epoch) == (b.state.global_step, b.state.epoch)

    def logged(state):
        return [{k: v for k, v in e.items() if k in ("step", "loss", "learning_rate", "grad_norm")}
                for e in state.log_history if "loss" in e]

    assert logged(a.state) == logged(b.state)


# -- the scenarios ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("crash_at, saver", [(7, "kit"), (17, "trainer")], ids=["in-epoch-1-kit-saves",
                                                                                  "across-epochs-trainer-saves"])
def test_can_resume_training(drive, local, model, crash_at, saver):
    """Resumed from checkpoint-5 (inside the first epoch) or checkpoint-15 (the second epoch): the same weights
    and the same logged history as a run that never stopped; the kit's saves or the Trainer's own."""
    args = {} if saver == "kit" else dict(save_strategy="steps", save_steps=5)
    save_every = 5 if saver == "kit" else None

    def make(run, **kw):
        return line_trainer(run, MODELS[model](), **kw)

    straight, _ = trained(drive, local, "straight", make, save_every=save_every, **args)
    again, resumed = trained(drive, local, "again", make, crash_at=crash_at, save_every=save_every, **args)
    assert resumed == 5 * (crash_at // 5)
    assert max_diff(weights(straight), weights(again)) == 0.0
    same_history(straight, again)


def test_resume_training_with_gradient_accumulation(drive, local):
    def make(run, **kw):
        return line_trainer(run, Line(), per_device_train_batch_size=4, gradient_accumulation_steps=2, **kw)

    straight, _ = trained(drive, local, "straight", make)
    again, resumed = trained(drive, local, "again", make, crash_at=7)
    assert resumed == 5 and max_diff(weights(straight), weights(again)) == 0.0
    same_history(straight, again)


def test_resume_training_with_frozen_params(drive, local):
    def make(run, **kw):
        model = LinePretrained(LineConfig())
        model.a.requires_grad_(False)
        return line_trainer(run, model, per_device_train_batch_size=4, **kw)

    straight, _ = trained(drive, local, "straight", make)
    again, resumed = trained(drive, local, "again", make, crash_at=7)
    assert resumed == 5 and not again.model.a.requires_grad and again.model.a.item() == 0.0
    assert max_diff(weights(straight), weights(again)) == 0.0


@pytest.mark.parametrize("saver", ["steps", "epochs"])
def test_resume_training_with_randomness(drive, local, saver):
    """Noise from torch's, numpy's and Python's RNGs in every forward pass: each is restored on resume."""
    args = dict(save_strategy="epoch") if saver == "epochs" else {}

    def make(run, **kw):
        return line_trainer(run, LinePretrained(LineConfig(b=2.0, noise=True)), data=Points(128), **kw)

    save_every = None if saver == "epochs" else 5
    straight, _ = trained(drive, local, "straight", make, save_every=save_every, **args)
    again, resumed = trained(drive, local, "again", make, crash_at=20, save_every=save_every, **args)
    assert resumed == (16 if saver == "epochs" else 20 - 5)
    assert max_diff(weights(straight), weights(again)) == 0.0


def test_resume_with_a_different_batch_size_is_refused_with_the_fresh_start_call(drive, local):
    def make(run, **kw):
        return line_trainer(run, Line(), **kw)

    trained(drive, local, "r", make, crash_at=7)  # finished at batch 8
    run = start(drive, local, "r", save_every=5, quiet=True, gauges=False)
    with pytest.raises(ck.ResumeMismatchError, match=r"effective batch size: 8 then, 4 now.*resume=False"):
        run.train(make(run, per_device_train_batch_size=4))
    run.finish(timeout=10)


class Regressor(torch.nn.Module):
    """A plain module taking a tokenizer's names, as in transformers' interrupted-training scenario."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(10, 2)

    def forward(self, input_ids, attention_mask=None, labels=None):
        logits = self.linear(input_ids)
        loss = torch.nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return {"loss": loss, "logits": logits}


class Rows(torch.utils.data.Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.rand(n, 10, generator=g), torch.randint(0, 2, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "attention_mask": torch.ones(10), "labels": self.y[i]}


@pytest.mark.parametrize("rows", [100, 13])
def test_resume_from_interrupted_training_into_a_longer_schedule(drive, local, rows):
    """Stopped by max_steps=2, then resumed with the same model object into one whole epoch (no max_steps)."""
    torch.manual_seed(0)
    model, data = Regressor(), Rows(rows)
    settings = dict(per_device_train_batch_size=2, gradient_accumulation_steps=3, learning_rate=0.1,
                    report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no")
    run = start(drive, local, "r", save_every=1, quiet=True, gauges=False)
    run.train(Trainer(model=model, args=TrainingArguments(str(run.local_dir), max_steps=2, **settings),
                      train_dataset=data))
    run = start(drive, local, "r", save_every=1, quiet=True, gauges=False)
    assert run.resume_manifest.step == 2
    trainer = Trainer(model=model, args=TrainingArguments(str(run.local_dir), num_train_epochs=1, **settings),
                      train_dataset=data)
    run.train(trainer)
    run.finish(timeout=30)
    last = math.ceil(rows / 6)
    assert trainer.state.global_step == last
    folders = dict(list_checkpoints(run.drive_dir / "checkpoints"))
    assert (folders[last] / "model.safetensors").is_file()


class OrderSeen(torch.nn.Module):
    """Records the first column of every batch it sees (a fixed-size buffer and a cursor, both saved)."""

    def __init__(self, most=64):
        super().__init__()
        self.linear = torch.nn.Linear(10, 10, bias=False)
        self.register_buffer("seen", torch.full((most,), -1, dtype=torch.long))
        self.register_buffer("cursor", torch.zeros((), dtype=torch.long))

    def forward(self, input_ids, labels=None):
        first = input_ids[:, 0].long()
        at = int(self.cursor)
        self.seen[at:at + len(first)] = first
        self.cursor += len(first)
        out = self.linear(input_ids)
        return {"loss": out.pow(2).mean(), "logits": out}


class Indexed(torch.utils.data.Dataset):
    """Ten rows whose first column is the row's index."""

    def __len__(self):
        return 10

    def __getitem__(self, i):
        row = torch.zeros(10)
        row[0] = i
        return {"input_ids": row}


@pytest.mark.parametrize("crash_at", [2, 7], ids=["resume-in-epoch-0", "resume-in-epoch-1"])
def test_resume_batch_order(drive, local, crash_at):
    """The batches after a resume come in the order an uninterrupted run sees them (SGD, 3 epochs, a save at
    every step), resumed inside the first epoch and inside the second."""
    def make(run, **kw):
        torch.manual_seed(42)
        return line_trainer(run, OrderSeen(), data=Indexed(), per_device_train_batch_size=2, optim="sgd",
                            learning_rate=0.1, **kw)

    straight, _ = trained(drive, local, "straight", make, save_every=1)
    again, resumed = trained(drive, local, "again", make, crash_at=crash_at, save_every=1)
    assert resumed == crash_at - 1
    order = straight.model.seen[:int(straight.model.cursor)]
    assert int(again.model.cursor) == 30 and torch.equal(again.model.seen[:30], order)
    assert max_diff(weights(straight), weights(again)) == 0.0


def test_early_stopping_state_is_restored_on_resume(drive, local):
    """EarlyStoppingCallback(5, 0.2) saved with the checkpoint comes back on resume, even where the resumed run
    builds it with the defaults (restore_callback_states_from_checkpoint, which the kit turns on)."""
    def make(run, stopping, **kw):
        return line_trainer(run, Line(), eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
                            load_best_model_at_end=True, metric_for_best_model="eval_loss", max_steps=8,
                            logging_steps=2, eval_data=Points(16, seed=7), callbacks=[stopping, *kw.pop("callbacks", [])],
                            **kw)

    run = start(drive, local, "r", save_every=None, quiet=True, gauges=False)
    trainer = make(run, EarlyStoppingCallback(5, 0.2), callbacks=[StopAt(5)])
    with pytest.raises(RuntimeError, match="simulated crash"):
        run.train(trainer)
    shutil.rmtree(local / "r")
    run = start(drive, local, "r", save_every=None, quiet=True, gauges=False)
    assert run.resume_manifest.step == 4
    trainer = make(run, EarlyStoppingCallback())
    run.train(trainer)
    run.finish(timeout=30)
    stopping = next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, EarlyStoppingCallback))
    assert (stopping.early_stopping_patience, stopping.early_stopping_threshold) == (5, 0.2)


def test_a_tied_language_model_resumes_exactly_and_stays_tied(drive, local):
    """GPT-2's head is its embedding matrix: the checkpoint stores it once, the resume ties it again."""
    import datasets
    from transformers import GPT2Config, GPT2LMHeadModel

    ids = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(0)).tolist()
    data = datasets.Dataset.from_dict({"input_ids": ids, "labels": ids})

    def make(run, **kw):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2))
        return line_trainer(run, model, data=data, learning_rate=1e-3, num_train_epochs=2, **kw)

    straight, _ = trained(drive, local, "straight", make)
    again, resumed = trained(drive, local, "again", make, crash_at=7)
    assert resumed == 5 and max_diff(weights(straight), weights(again)) == 0.0
    model = again.model
    assert model.lm_head.weight is model.transformer.wte.weight
