"""CheckpointStore for plain PyTorch loops."""

import os
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import colab_kit as ck
from colab_kit.checkpoints.journal import read_events
from colab_kit.checkpoints.validity import verify_folder


def tiny_setup(seed=0, width=8):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.ReLU(), torch.nn.Linear(width, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return model, opt, sched


def train_steps(model, opt, sched, n):
    for _ in range(n):
        x = torch.randn(16, 4)
        loss = model(x).pow(2).mean() + 0.01 * torch.randn(()).item()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


def test_save_and_restore_round_trip_with_rng_and_extra(drive, local):
    model, opt, sched = tiny_setup()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    train_steps(model, opt, sched, 5)
    with ck.CheckpointStore(drive, keep=2, local_dir=local) as store:
        random.seed(1), np.random.seed(2), torch.manual_seed(3)
        store.save(5, model=model, optimizer=opt, scheduler=sched, scaler=scaler, epoch=1, best=0.25,
                   history=[1, 2])
        expected = (random.random(), np.random.rand(), torch.rand(1).item())
    assert verify_folder(drive / "checkpoints" / "checkpoint-5") is None

    shutil.rmtree(local)
    model2, opt2, sched2 = tiny_setup(seed=99)
    scaler2 = torch.amp.GradScaler("cpu")
    with ck.CheckpointStore(drive, keep=2, local_dir=local) as store:
        assert store.restore_latest(model=model2, optimizer=opt2, scheduler=sched2, scaler=scaler2) == 5
        assert store.extra == {"epoch": 1, "best": 0.25, "history": [1, 2]}
        assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)
    assert opt2.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    assert sched2.last_epoch == 5 and scaler2.get_scale() == 1024.0


def test_tied_weights_are_saved_once_and_restored(drive, local):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    model = GPT2LMHeadModel(cfg)
    with ck.CheckpointStore(drive, local_dir=local) as store:
        store.save(1, model=model)
    other = GPT2LMHeadModel(cfg)
    with ck.CheckpointStore(drive, local_dir=local) as store:
        assert store.restore_latest(model=other) == 1
    assert torch.equal(other.lm_head.weight, model.transformer.wte.weight)
    assert other.lm_head.weight.data_ptr() == other.transformer.wte.weight.data_ptr()


def test_empty_store_restores_nothing(drive):
    with ck.CheckpointStore(drive) as store:
        assert store.restore_latest(model=torch.nn.Linear(2, 2)) is None


def test_keeps_keep_checkpoints_and_skips_damaged_ones(drive, local, capsys):
    model, opt, sched = tiny_setup()
    with ck.CheckpointStore(drive, keep=2, local_dir=local) as store:
        for step in (1, 2, 3):
            store.save(step, model=model, optimizer=opt)
            store.wait()
    names = sorted(p.name for p in (drive / "checkpoints").iterdir())
    assert names == ["checkpoint-2", "checkpoint-3"]
    (drive / "checkpoints" / "checkpoint-3" / "model.safetensors").write_bytes(b"garbage")
    shutil.rmtree(local)
    with ck.CheckpointStore(drive, keep=2, local_dir=local) as store:
        assert store.restore_latest(model=model, optimizer=opt) == 2
    assert "skipping checkpoint" in capsys.readouterr().err
    warns = [e for e in read_events(drive / "events.jsonl") if e["event"] == "warn"]
    assert warns[-1]["what"] == "invalid_checkpoint" and warns[-1]["path"].endswith("checkpoint-3")


def test_wrong_model_is_refused(drive, local):
    with ck.CheckpointStore(drive, local_dir=local) as store:
        store.save(1, model=torch.nn.Linear(4, 4))
    with ck.CheckpointStore(drive, local_dir=local) as store:
        with pytest.raises(ck.ResumeMismatchError, match="different tensor names or shapes"):
            store.restore_latest(model=torch.nn.Linear(4, 5))


def test_missing_state_is_a_clear_error(drive, local):
    model, opt, _ = tiny_setup()
    with ck.CheckpointStore(drive, local_dir=local) as store:
        store.save(1, model=model)
    with ck.CheckpointStore(drive, local_dir=local) as store:
        with pytest.raises(ck.CheckpointError, match="no optimizer state"):
            store.restore_latest(model=model, optimizer=opt)


def test_closed_store_refuses_to_save(drive, local):
    store = ck.CheckpointStore(drive, local_dir=local)
    store.close()
    assert store.close() is True  # idempotent
    with pytest.raises(ck.CheckpointError, match="closed"):
        store.save(1, model=torch.nn.Linear(2, 2))


def test_run_checkpoint_store_shares_the_run_folder(drive, local):
    run = ck.start_run("plain", drive=drive, local_dir=local, quiet=True)
    store = run.checkpoint_store()
    store.save(3, model=torch.nn.Linear(2, 2))
    run.finish()
    assert verify_folder(drive / "plain" / "checkpoints" / "checkpoint-3") is None
    kinds = [e["event"] for e in read_events(drive / "plain" / "events.jsonl")]
    assert kinds[:1] == ["start"] and "save" in kinds and "sync" in kinds and kinds[-1] == "finish"


def test_a_save_killed_halfway_leaves_no_staging_behind_at_the_next_start(drive, local, monkeypatch):
    """A process killed inside `save` leaves its half-written staging folder on the local disk; the next store
    on that folder removes it. A staging folder of a live process (this one's) is left alone."""
    from colab_kit.loop.statefiles import staging_name

    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    with monkeypatch.context() as m:
        m.setattr(os, "getpid", lambda: int(ended.stdout))
        abandoned = local / staging_name(4, "deadbeef")
    (abandoned / "shards").mkdir(parents=True)
    (abandoned / "shards" / "__0_0.distcp").write_bytes(b"x" * 1000)
    live = local / staging_name(6, "cafecafe")
    live.mkdir()
    with ck.CheckpointStore(drive, local_dir=local):
        pass
    assert not abandoned.exists() and live.exists()


def test_finishing_the_run_names_a_background_save_the_store_has_not_finished(drive, local, capsys):
    """A sharded save still written in the background is published by the store's next call (a collective
    of every rank); run.finish() cannot make it, so it says which checkpoint is not saved and what to do."""
    run = ck.start_run("plain", drive=drive, local_dir=local, quiet=True)
    store = run.checkpoint_store()
    store._pending = (7, local / "staging", {})  # what an async save leaves until the next call
    run.finish()
    said = capsys.readouterr()
    assert "checkpoint-7 was still being written in the background" in said.out + said.err
    assert "call store.close() (on every rank) before run.finish()" in said.out + said.err
