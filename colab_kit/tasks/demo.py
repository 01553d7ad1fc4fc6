"""A tiny, self-contained training run: the kit end to end in under a minute on a CPU.

    python -m colab_kit demo            # ./drive stands in for Google Drive

It trains a 2-layer BERT classifier (built from a config, no download) on a generated task,
through `start_run` + `run.train`, so checkpoints, the journal and resume can be watched.
Run it twice: the second run finds the finished checkpoint and does not train again.
The builders here are also used by the tests and benchmarks.
"""

from __future__ import annotations

import argparse

__all__ = ["tiny_bert_config", "toy_classification", "tiny_trainer", "main"]

VOCAB = 32
MOTIF = (7, 8, 9)


def tiny_bert_config(num_labels: int = 2, dropout: float = 0.1, hidden: int = 32, layers: int = 2,
                     vocab_size: int = VOCAB):
    """A BERT small enough to train in seconds on a CPU (a larger `vocab_size` makes checkpoints
    heavier without making steps slower: the extra embedding rows are never looked up)."""
    from transformers import BertConfig

    return BertConfig(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=2, intermediate_size=2 * hidden, max_position_embeddings=64,
                      num_labels=num_labels, hidden_dropout_prob=dropout,
                      attention_probs_dropout_prob=dropout, pad_token_id=0)


def toy_classification(n: int = 512, length: int = 24, seed: int = 0):
    """Token sequences labelled 1 when they contain the motif 7-8-9 (half of them do)."""
    import datasets
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = rng.integers(4, VOCAB, size=(n, length))
    labels = rng.integers(0, 2, size=n)
    for row, label in zip(ids, labels):
        row[row == MOTIF[0]] = 4  # no accidental motif in negatives
        if label:
            start = rng.integers(1, length - len(MOTIF))
            row[start:start + len(MOTIF)] = MOTIF
    ids[:, 0] = 2  # [CLS]
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})


def tiny_trainer(run, *, max_steps: int = 60, batch_size: int = 16, dropout: float = 0.1,
                 seed: int = 0, train_dataset=None, callbacks=None, vocab_size: int = VOCAB,
                 eval_dataset=None, compute_metrics=None, **training_args):
    """A Trainer for the tiny BERT that writes to `run.local_dir`."""
    import torch
    from transformers import BertForSequenceClassification, Trainer, TrainingArguments

    torch.manual_seed(seed)
    model = BertForSequenceClassification(tiny_bert_config(dropout=dropout, vocab_size=vocab_size))
    defaults = dict(max_steps=max_steps, per_device_train_batch_size=batch_size, learning_rate=3e-3,
                    save_strategy="no", logging_steps=10, report_to=[], use_cpu=True,
                    disable_tqdm=True, seed=seed)
    args = TrainingArguments(str(run.local_dir), **(defaults | training_args))
    return Trainer(model=model, args=args, train_dataset=train_dataset or toy_classification(seed=seed),
                   eval_dataset=eval_dataset, compute_metrics=compute_metrics, callbacks=callbacks)


def main(argv: list[str] | None = None) -> int:
    import torch

    import colab_kit as ck

    parser = argparse.ArgumentParser(prog="python -m colab_kit demo", description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="demo")
    parser.add_argument("--drive", default=None, help="root folder standing in for Drive (default ./drive)")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--save-every", default="20", help='steps (an int) or a duration like "30s"')
    args = parser.parse_args(argv)
    save_every = int(args.save_every) if args.save_every.isdigit() else args.save_every

    run = ck.start_run(args.name, drive=args.drive, save_every=save_every)
    trainer = tiny_trainer(run, max_steps=args.steps)
    output = run.train(trainer)
    test = toy_classification(n=256, seed=1)
    model = trainer.model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(test["input_ids"])).logits
    accuracy = (logits.argmax(-1) == torch.tensor(test["labels"])).float().mean().item()
    print(f"demo: {output.global_step} steps, held-out accuracy {accuracy:.3f} "
          f"(chance 0.5); journal: {run.drive_dir / 'events.jsonl'}")
    return 0
