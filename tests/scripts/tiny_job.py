"""A tiny training job for end-to-end tests: run it, SIGKILL it anywhere, run it again.

    python tiny_job.py --drive D --local L --out final.safetensors [--loop trainer|plain|lora|sft]
                       [--kill PHASE:K] [--step-sleep S] [--vocab N] [--keep K] [--save-every N|"2s"]
                       [--prune-after written] [--hostname NAME] [--heartbeat S] [--best min|max]

--loop lora trains a LoRA adapter (peft) on a tiny Llama-shaped causal LM, --loop sft the same with TRL's
SFTTrainer (its checkpoints hold the adapter only, whatever --vocab makes the base weigh).
--vocab makes checkpoints heavier (unused embedding rows); --prune-after written runs the pruning
rule before 0.2; --hostname makes the job look as if it ran on another VM; --best adds
load_best_model_at_end and early stopping; --confirm sets start_run's confirm; --settle and
--assumed-rate set start_run's settle rule (a mount without attributes); --timings FILE appends "step seconds time" for every optimizer
step (the seconds since the previous step ended, less --step-sleep: what the loop waited for). A
live lease of another runtime ends the job with exit code 3.

--kill makes the job SIGKILL itself the K-th time it reaches PHASE, in the middle of the
operation (half a chunk written, a manifest half renamed, ...):
  step        after an optimizer step          local_save  between model and optimizer files
  upload      half-way through a data file     manifest    half-way through MANIFEST.json's temp
  prune       after a manifest was removed     journal     half-way through an events.jsonl line
  fetch       while copying a checkpoint back from Drive at resume
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class Killer:
    def __init__(self, spec: str | None):
        self.phase, self.k = (spec.split(":")[0], int(spec.split(":")[1])) if spec else (None, 0)
        self.seen = 0

    def hit(self, phase: str) -> bool:
        if phase != self.phase:
            return False
        self.seen += 1
        return self.seen == self.k


def install_kill_hooks(killer: Killer, drive: Path) -> None:
    from colab_kit.checkpoints import storage
    from colab_kit.drive import deleters
    from colab_kit.loop import statefiles

    write_chunk = storage._write_chunk

    def chunk(fh, data):
        name = getattr(fh, "name", "")
        if str(drive) in str(name):
            phase = "manifest" if "MANIFEST.json" in str(name) else "upload"
            if killer.hit(phase):
                fh.write(data[: max(1, len(data) // 2)])
                fh.flush()
                die()
        if ".fetch-" in str(name) and killer.hit("fetch"):
            fh.write(data[: len(data) // 2])
            fh.flush()
            die()
        write_chunk(fh, data)

    storage._write_chunk = chunk

    append_line = storage.append_line

    def journal(path, line):
        if str(drive) in str(path) and line.strip() and killer.hit("journal"):
            with open(path, "a") as fh:
                fh.write(line[: len(line) // 2])
            die()
        append_line(path, line)

    storage.append_line = journal

    remove_tree = deleters._remove_tree

    def prune(folder, first):
        if first is not None and killer.hit("prune"):
            (folder / first).unlink(missing_ok=True)
            die()
        remove_tree(folder, first)

    deleters._remove_tree = prune

    save_fsynced = statefiles.save_fsynced

    def plain_local_save(obj, path):
        if Path(path).name == "optimizer.pt" and killer.hit("local_save"):
            die()
        save_fsynced(obj, path)

    statefiles.save_fsynced = plain_local_save

    from transformers import Trainer

    save_opt = Trainer._save_optimizer_and_scheduler

    def trainer_local_save(self, output_dir):
        if killer.hit("local_save"):
            die()
        save_opt(self, output_dir)

    Trainer._save_optimizer_and_scheduler = trainer_local_save


def start(args, **overrides):
    import colab_kit as ck

    kwargs = dict(drive=args.drive, local_dir=args.local, save_every=args.save_every, keep=args.keep,
                  heartbeat_s=args.heartbeat, settle=args.settle, assumed_rate=args.assumed_rate,
                  confirm=args.confirm) | overrides
    try:
        run = ck.start_run(args.name, **kwargs)
    except ck.LeaseHeldError as exc:
        print(f"LEASE HELD: {exc}", flush=True)
        sys.exit(3)
    return run


def run_trainer(args, killer: Killer):
    from transformers import TrainerCallback

    from colab_kit.tasks.demo import tiny_trainer

    timings = open(args.timings, "a", buffering=1) if args.timings else None
    last = [time.perf_counter()]

    class Hooks(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            if timings is not None:
                now = time.perf_counter()
                timings.write(f"{state.global_step} {now - last[0]:.4f} {time.time():.3f}\n")
            time.sleep(args.step_sleep)
            last[0] = time.perf_counter()
            if killer.hit("step"):
                die()

    run = start(args)
    options = best_model_options(args.best) if args.best else {}
    callbacks = [Hooks(), *options.pop("callbacks", [])]
    if args.loop in ("lora", "sft"):
        trainer = adapter_trainer(run, args, callbacks)
    else:
        trainer = tiny_trainer(run, max_steps=args.steps, dropout=0.1, callbacks=callbacks, vocab_size=args.vocab,
                               **options)
    output = run.train(trainer)
    if args.best:
        print(f"BEST step={trainer.state.best_global_step} metric={trainer.state.best_metric!r} "
              f"stopped_at={trainer.state.global_step}", flush=True)
    return trainer.model, output.global_step


def adapter_trainer(run, args, callbacks):
    """A LoRA adapter (r=4 on q_proj and v_proj, dropout on) of a tiny Llama-shaped causal LM built from a config,
    trained by the HF Trainer (--loop lora) or by TRL's SFTTrainer on the same token blocks (--loop sft)."""
    import datasets
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=args.vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"],
                                            task_type="CAUSAL_LM"))
    ids = torch.randint(4, args.vocab, (128, 16), generator=torch.Generator().manual_seed(0)).tolist()
    data = datasets.Dataset.from_dict({"input_ids": ids, "labels": ids})
    settings = dict(max_steps=args.steps, per_device_train_batch_size=8, learning_rate=1e-2, report_to=[], use_cpu=True,
                    disable_tqdm=True, logging_steps=10, seed=0, save_strategy="no")
    if args.loop == "lora":
        return Trainer(model=model, args=TrainingArguments(str(run.local_dir), **settings), train_dataset=data,
                       callbacks=callbacks)
    from trl import SFTConfig, SFTTrainer
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(args.vocab)}  # a tokenizer the data never needs: SFTTrainer asks for one
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                        pad_token="t1", eos_token="t2", bos_token="t3")
    sft = SFTConfig(str(run.local_dir), max_length=16, dataset_kwargs={"skip_prepare_dataset": True}, **settings)
    return SFTTrainer(model=model, args=sft, train_dataset=data, processing_class=tokenizer, callbacks=callbacks)


def best_model_options(direction: str) -> dict:
    """HF's early-stopping resume scenario: evaluate and save every 10 steps, keep the best model,
    stop after 2 evaluations without improvement. The metric, the mean size of the evaluation
    logits, grows as the model learns, so the best checkpoint is the first one (the smallest
    logits, or the largest negated logits with greater_is_better=True)."""
    import numpy as np
    from transformers import EarlyStoppingCallback

    from colab_kit.tasks.demo import toy_classification

    def logit_size(prediction):
        size = float(np.abs(prediction.predictions).mean())
        return {"logit_size": size} if direction == "min" else {"neg_logit_size": -size}

    return dict(eval_strategy="steps", eval_steps=10, save_strategy="steps", save_steps=10,
                load_best_model_at_end=True, greater_is_better=direction == "max",
                metric_for_best_model="logit_size" if direction == "min" else "neg_logit_size",
                eval_dataset=toy_classification(n=64, seed=2), compute_metrics=logit_size,
                callbacks=[EarlyStoppingCallback(early_stopping_patience=2)])


def run_plain(args, killer: Killer):
    import torch
    from transformers import BertForSequenceClassification

    from colab_kit.tasks.demo import tiny_bert_config, toy_classification

    run = start(args, save_every=None)
    store = run.checkpoint_store()
    torch.manual_seed(0)
    model = BertForSequenceClassification(tiny_bert_config(dropout=0.1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / args.steps)
    data = toy_classification(n=256)
    ids, labels = torch.tensor(data["input_ids"]), torch.tensor(data["labels"])
    batch, n = 16, len(labels)
    step = store.restore_latest(model=model, optimizer=opt, scheduler=sched) or 0
    model.train()
    while step < args.steps:
        epoch, pos = divmod(step * batch, n)
        # The data order is a function of (seed, epoch): a resume jumps to its position by index.
        order = torch.randperm(n, generator=torch.Generator().manual_seed(1000 + epoch))
        idx = order[pos:pos + batch]
        loss = model(input_ids=ids[idx], labels=labels[idx]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        step += 1
        time.sleep(args.step_sleep)
        if killer.hit("step"):
            die()
        if step % args.save_every == 0 or step == args.steps:
            store.save(step, model=model, optimizer=opt, scheduler=sched)
    run.finish()
    return model, step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--drive", required=True)
    parser.add_argument("--local", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--name", default="job")
    parser.add_argument("--loop", choices=["trainer", "plain", "lora", "sft"], default="trainer")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--save-every", default="10", help="steps, or a duration such as 2s")
    parser.add_argument("--keep", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=32)
    parser.add_argument("--heartbeat", type=float, default=1.0)
    parser.add_argument("--prune-after", choices=["cloud", "written"], default="cloud")
    parser.add_argument("--hostname", default=None)
    parser.add_argument("--kill", default=None)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--settle", default="10min")
    parser.add_argument("--assumed-rate", default="1MB/s")
    parser.add_argument("--confirm", choices=["auto", "attributes", "api"], default="auto",
                        help="start_run(confirm=...); 'api' reads COLAB_KIT_DRIVE_API and COLAB_KIT_DRIVE_ROOT")
    parser.add_argument("--timings", default=None)
    parser.add_argument("--best", choices=["min", "max"], default=None,
                        help="load_best_model_at_end with early stopping, the metric minimised or maximised")
    parser.add_argument("--look-spacing", type=float, default=None,
                        help="the first wait between looks (the kit's: 1 s); the emulator hides an entry from one "
                             "listing at a time, so shorter spacing is still spaced enough there")
    args = parser.parse_args()
    args.save_every = int(args.save_every) if args.save_every.isdigit() else args.save_every
    if args.hostname:  # before colab_kit reads it: this job runs "on another VM"
        import socket

        socket.gethostname = lambda: args.hostname
    if os.environ.get("HF_HUB_DISABLE_XET"):  # the emulated Hub (--drive hf://...): the forkserver imported the
        from huggingface_hub import constants  # client before this job's environment was set

        constants.HF_HUB_DISABLE_XET = True
    import colab_kit.run.start

    colab_kit.run.start._PRUNE_AFTER = args.prune_after
    if args.look_spacing is not None:
        from colab_kit.checkpoints import looks, search

        step = args.look_spacing
        looks.WAITS, search.RETRY_WAITS = (step, 2 * step, 3 * step), (step, 2 * step, 4 * step, 4 * step)
    killer = Killer(args.kill)
    install_kill_hooks(killer, Path(args.drive).absolute())
    model, step = (run_plain if args.loop == "plain" else run_trainer)(args, killer)
    from safetensors.torch import save_model

    save_model(model, args.out)
    print(f"FINAL step={step}", flush=True)


if __name__ == "__main__":
    main()
