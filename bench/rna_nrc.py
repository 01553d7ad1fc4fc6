"""nRC ncRNA family classification on the real data: a from-scratch nucleotide model vs k-mer baselines.

    python bench/rna_nrc.py [--seeds 3] [--kmer 4] [--epochs 12] [--dropout 0.1] [--mlm-epochs 0] [--size tiny]
                            [--layers 0] [--micro-batch 8] [--max-length 256] [--lr 2e-3] [--validation] [--data DIR]

Reads the nRC benchmark (6,320 training and 2,600 test sequences, 13 families) from
`../shared/data/nrc/` (skips cleanly when it is absent), splits 10 % validation off the training
set, and reports accuracy, macro-F1 and MCC on the full test set and on the test set without the
sequences that also occur in training, for, in the same run:

- k-mer (1-5) frequencies + logistic regression (the baseline of the nRC literature, ~85 %),
- the same with TF-IDF weighting (a stronger variant),
- the notebook's from-scratch model (`rna.scratch_bert_config`, "tiny": 2 layers x 128, reading
  overlapping 4-mers, dropout 0.1) trained through `ck.start_run` + `run.train` (with
  `--mlm-epochs N`, first as a masked LM on the training split's sequences,
  `rna.pretrain_masked_lm`), once per seed (0 .. N-1: initialisation, masking, dropout and data
  order; the split and the baselines stay the same), each run listed, then the mean +- standard
  deviation of each column, and a summary that compares the mean with each baseline.

`--validation` is for choosing a recipe: it scores everything on the validation split (the
baselines fitted on the rest of the training set) and never reads the test file.

Each seed is sized for <= 30 minutes on a 2-core CPU. Batches are not grouped by length: in nRC
length nearly gives the family away, and length-sorted batches made training collapse. Each
32-row batch is instead run as micro-batches of 8 (`run.train(micro_batch=8)`), ordered by length
within the batch: the same gradient on about two thirds of the padded tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "nrc"
TRAIN, TEST = "dataset_Rfam_6320_13classes.fasta", "dataset_Rfam_validated_2600_13classes.fasta"
COLUMNS = ("accuracy", "macro-F1", "MCC", "dedup accuracy", "dedup macro-F1")
TARGETS = (0, 1, 3, 4)  # the columns the model must beat the baselines on: accuracy and macro-F1, full and dedup


def kmer_baseline(train, val, train_all, test, tfidf: bool) -> tuple[list[str], float]:
    """Predictions for `test`, with the regularisation chosen on the validation split (then refit
    on all training data); returns (predictions, chosen C)."""
    from sklearn.feature_extraction.text import CountVectorizer, TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import FunctionTransformer, StandardScaler, normalize

    def pipeline(c):
        if tfidf:
            features = [TfidfVectorizer(analyzer="char", ngram_range=(1, 5), lowercase=False, sublinear_tf=True)]
        else:  # k-mer frequencies (counts over the sequence's k-mer total), standardised
            features = [CountVectorizer(analyzer="char", ngram_range=(1, 5), lowercase=False),
                        FunctionTransformer(lambda x: normalize(x, norm="l1").toarray()), StandardScaler()]
        return make_pipeline(*features, LogisticRegression(max_iter=3000, C=c))

    grid = (1.0, 10.0, 100.0) if tfidf else (0.01, 0.1, 1.0)
    scores = {c: (pipeline(c).fit(train.sequences, train.labels).predict(val.sequences) == np.array(val.labels)).mean()
              for c in grid}
    best = max(scores, key=scores.get)
    return list(pipeline(best).fit(train_all.sequences, train_all.labels).predict(test.sequences)), best


def scratch_model(train, val, test, labels, args, workdir: Path, seed: int):
    import torch
    from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding, Trainer, TrainingArguments

    import colab_kit as ck
    from colab_kit import rna

    label2id = {label: i for i, label in enumerate(labels)}
    tokenizer = rna.nucleotide_tokenizer(model_max_length=args.max_length, k=args.kmer)
    data = {name: rna.to_dataset(part, tokenizer, args.max_length, label2id)
            for name, part in (("train", train), ("validation", val), ("test", test))}
    config = rna.scratch_bert_config(len(tokenizer), len(labels), args.max_length, size=args.size,
                                     layers=args.layers or None, dropout=args.dropout)
    started = time.perf_counter()  # pre-training counts in the model's time
    pretrained = None
    if args.mlm_epochs:  # self-pre-training on the training split's sequences
        mlm_run = ck.start_run("nrc-bench-mlm", drive=workdir / "drive", local_dir=workdir / "local-mlm",
                               save_every="10min", quiet=True, gauges=False)
        pretrained = rna.pretrain_masked_lm(mlm_run, config, tokenizer, train, args.max_length,
                                            epochs=args.mlm_epochs, learning_rate=args.lr, micro_batch=args.micro_batch,
                                            seed=seed)
        losses = json.loads((pretrained / "metrics.json").read_text())["masked_lm_loss"]
        print(f"masked-LM pre-training: {args.mlm_epochs} epochs, loss at every 5 % of its steps "
              f"{[round(x, 3) for x in losses]}", flush=True)
    run = ck.start_run("nrc-bench", drive=workdir / "drive", local_dir=workdir / "local", save_every="10min",
                       quiet=True, gauges=False)
    torch.manual_seed(seed)
    if pretrained is None:
        model = AutoModelForSequenceClassification.from_config(config)
    else:  # the encoder from pre-training; the classification head starts fresh
        model = AutoModelForSequenceClassification.from_pretrained(str(pretrained), config=config)
    steps = args.epochs * math.ceil(len(train) / 32)
    training = TrainingArguments(
        str(run.local_dir), num_train_epochs=args.epochs, per_device_train_batch_size=32, per_device_eval_batch_size=64,
        learning_rate=args.lr, warmup_steps=int(0.06 * steps), weight_decay=0.01, eval_strategy="epoch",
        save_strategy="no", logging_steps=100, report_to=[], seed=seed, disable_tqdm=True,
        **ck.memory_args(run.runtime, group_by_length=False))
    trainer = Trainer(model=model, args=training, train_dataset=data["train"], eval_dataset=data["validation"],
                      data_collator=DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8),
                      compute_metrics=lambda p: {"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())})
    run.train(trainer, micro_batch=args.micro_batch)
    seconds = time.perf_counter() - started
    curve = [round(e["eval_accuracy"], 3) for e in trainer.state.log_history if "eval_accuracy" in e]
    output = trainer.predict(data["test"])
    order = [labels[int(i)] for i in output.label_ids]  # predict may return rows in its own order
    predicted = [labels[int(i)] for i in output.predictions.argmax(-1)]
    return order, predicted, seconds, curve, model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--seeds", type=int, default=3, help="runs of the model, with seeds 0 .. N-1")
    parser.add_argument("--epochs", type=int, default=12, help="fine-tuning epochs")
    parser.add_argument("--mlm-epochs", type=int, default=0, help="masked-LM pre-training epochs (0: none)")
    parser.add_argument("--size", choices=["tiny", "small"], default="tiny")
    parser.add_argument("--layers", type=int, default=0, help="overrides the size's depth (0: the size's own)")
    parser.add_argument("--micro-batch", type=int, default=8,
                        help="rows per micro-batch of the 32-row batch (length-sorted: less padding)")
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--kmer", type=int, default=4, help="token size: 1 per nucleotide, 2-6 overlapping k-mers")
    parser.add_argument("--validation", action="store_true",
                        help="score on the validation split (baselines fit on the rest of training); the test file "
                             "is not read: for choosing a recipe")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--dropout", type=float, default=0.1, help="in the embeddings, attention and MLP blocks")
    args = parser.parse_args()
    if args.seeds < 1:
        parser.error("--seeds: give 1 or more")
    if not (args.data / TRAIN).exists() or not (args.data / TEST).exists():
        print(f"skipped: the nRC files are not in {args.data} (the benchmark needs {TRAIN} and {TEST})")
        return 0
    from colab_kit import rna

    started = time.perf_counter()
    train_all = rna.clean_records(rna.read_sequences(args.data / TRAIN))[0]
    labels = sorted(set(train_all.labels))
    train_idx, val_idx = rna.stratified_split(train_all.labels, fraction=0.1, seed=0)
    train, val = train_all.subset(train_idx), train_all.subset(val_idx)
    if args.validation:  # choosing a recipe: the validation split stands in for the test set, which stays unread
        part, fitted, test = "validation", train, val
    else:
        part, fitted, test = "test", train_all, rna.clean_records(rna.read_sequences(args.data / TEST))[0]
    seen = rna.seen_in_training(fitted, test)
    fresh = ~np.array(seen)
    rows = []

    def score(name, predicted, seconds, note=""):
        truth, predicted = np.array(test.labels), np.array(predicted)
        full = rna.classification_metrics(list(truth), list(predicted), labels)
        dedup = rna.classification_metrics(list(truth[fresh]), list(predicted[fresh]), labels)
        rows.append((name, full, dedup, seconds, note))

    for name, tfidf in (("k-mer (1-5) frequencies + LR", False), ("k-mer (1-5) TF-IDF + LR", True)):
        t0 = time.perf_counter()
        predicted, c = kmer_baseline(train, val, fitted, test, tfidf)
        score(name, predicted, time.perf_counter() - t0, f"C={c:g}, chosen on the validation split")
    recipe = f"MLM {args.mlm_epochs} + {args.epochs} ep." if args.mlm_epochs else f"{args.epochs} ep."
    recipe = f"{args.kmer}-mers, {recipe}" if args.kmer > 1 else recipe
    for seed in range(args.seeds):
        with tempfile.TemporaryDirectory() as tmp:
            order, predicted, seconds, curve, model = scratch_model(train, val, test, labels, args, Path(tmp), seed)
        if order != test.labels:  # the de-duplication mask assumes the test set's order
            raise RuntimeError("the Trainer returned the test rows in another order; cannot de-duplicate")
        params = sum(p.numel() for p in model.parameters())
        shape = f"{model.config.num_hidden_layers}x{model.config.hidden_size}"
        score(f"from-scratch {shape} ({params / 1e6:.2f} M, {recipe}) seed {seed}", predicted, seconds,
              f"validation accuracy per epoch: {curve}")
        print(f"seed {seed} done: {part} accuracy {rows[-1][1]['accuracy']:.3f} in {seconds:.0f} s", flush=True)

    print(f"\nnRC: {len(train)} training and {len(val)} validation sequences; scored on the {part} set "
          f"({len(test)}, {sum(seen)} of them also in training; {int(fresh.sum())} de-duplicated); "
          f"max_length {args.max_length}\n")
    print(f"{'method':<64}{'acc':>13}{'macro-F1':>13}{'MCC':>13}{'dedup acc':>13}{'dedup F1':>13}{'time s':>8}")
    for name, full, dedup, seconds, _ in rows:
        print(f"{name:<64}" + "".join(f"{v:>13.3f}" for v in columns(full, dedup)) + f"{seconds:>8.0f}")
    runs = rows[2:]
    table = np.array([columns(full, dedup) for _, full, dedup, *_ in runs])
    mean, sd = table.mean(0), (table.std(0, ddof=1) if len(runs) > 1 else np.zeros(table.shape[1]))
    print(f"{f'from-scratch, mean +- sd over {len(runs)} seeds':<64}"
          + "".join(f"{f'{m:.3f}+-{d:.3f}':>13}" for m, d in zip(mean, sd))
          + f"{np.mean([r[3] for r in runs]):>8.0f}")
    for name, *_, note in rows:
        if note:
            print(f"\n{name}: {note}")
    for name, full, dedup, *_ in rows[:2]:
        base = columns(full, dedup)
        above = [COLUMNS[i] for i in TARGETS if mean[i] > base[i]]
        print(f"\nmean of {len(runs)} seeds vs {name}: above on {len(above)} of {len(TARGETS)} "
              f"({', '.join(above) or 'none'}); " + ", ".join(f"{COLUMNS[i]} {mean[i]:.3f} vs {base[i]:.3f}"
                                                              for i in TARGETS))
    print(f"wall time {time.perf_counter() - started:.0f} s")
    return 0


def columns(full: dict, dedup: dict) -> list[float]:
    return [full["accuracy"], full["macro_f1"], full["mcc"], dedup["accuracy"], dedup["macro_f1"]]


if __name__ == "__main__":
    sys.exit(main())
