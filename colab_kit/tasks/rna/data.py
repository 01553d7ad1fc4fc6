"""RNA data after reading: cleaning with a report, lengths, generated families for the quick preset,
and the splits a notebook trains and tests on. Strings and labels only: no torch here.
"""

from __future__ import annotations

import collections
import random
from dataclasses import dataclass, field

from .files import NUCLEOTIDES, Records, RnaDataError

__all__ = ["CleaningReport", "clean_records", "check_test_labels", "seen_in_training", "length_stats",
           "length_label_association", "choose_max_length", "generate_rna_families", "stratified_split", "Splits",
           "prepare_splits"]

@dataclass
class CleaningReport:
    sequences: int = 0
    changed: int = 0
    whitespace: int = 0
    lowercase: int = 0
    t_to_u: int = 0
    replaced: collections.Counter = field(default_factory=collections.Counter)

    def __str__(self) -> str:
        other = ", ".join(f"{c!r} x{n}" for c, n in self.replaced.most_common(6)) or "none"
        return (f"{self.changed} of {self.sequences} sequences changed: {self.whitespace} whitespace characters "
                f"removed, {self.lowercase} lower-case letters upper-cased, {self.t_to_u} T turned into U, "
                f"other characters turned into N: {other}")


def clean_records(records: Records) -> tuple[Records, CleaningReport]:
    """Strip whitespace, upper-case, T -> U, keep IUPAC codes, anything else -> N; with a report."""
    report = CleaningReport(sequences=len(records))
    cleaned = []
    allowed = set(NUCLEOTIDES)
    for sequence in records.sequences:
        out = []
        for char in sequence:
            if char.isspace():
                report.whitespace += 1
                continue
            upper = char.upper()
            if upper != char:
                report.lowercase += 1
            if upper == "T":
                report.t_to_u += 1
                upper = "U"
            if upper not in allowed:
                report.replaced[char] += 1
                upper = "N"
            out.append(upper)
        new = "".join(out)
        report.changed += new != sequence
        cleaned.append(new)
    return Records(cleaned, list(records.labels), records.source, list(records.lines), list(records.names)), report


def check_test_labels(train: Records, test: Records) -> None:
    """Every test label must occur in training (the model cannot predict an unseen class)."""
    known = set(train.labels)
    for i, label in enumerate(test.labels):
        if label not in known:
            where = f", line {test.lines[i]}" if test.lines else ""
            raise RnaDataError(f"{test.source}{where}: label '{label}' never occurs in the training data "
                               f"{train.source} ({len(known)} labels: {', '.join(sorted(known)[:8])}...)")


def seen_in_training(train: Records, test: Records) -> list[bool]:
    """For each test sequence: does the identical (cleaned) sequence occur in training?"""
    known = set(train.sequences)
    return [s in known for s in test.sequences]


def length_stats(sequences: list[str]) -> dict:
    import numpy as np

    lengths = np.array([len(s) for s in sequences])
    stats = {"count": int(lengths.size), "min": int(lengths.min()), "mean": float(lengths.mean()), "max": int(lengths.max())}
    for p in (50, 90, 95, 98, 99):
        stats[f"p{p}"] = float(np.percentile(lengths, p))
    return stats


def length_label_association(records: Records) -> float:
    """How much of the variance of sequence length the labels explain (the correlation ratio η²).

    Length-grouped batches cut padding, but where length nearly is the label (nRC: tRNAs are
    ~75 nt, 5S rRNAs ~120 nt; η² = 0.60) a length-sorted batch holds a single family and
    training collapses to predicting one class. Group by length only when this is small.
    """
    import numpy as np

    lengths = np.array([len(s) for s in records.sequences], dtype=float)
    labels = np.array(records.labels)
    total = ((lengths - lengths.mean()) ** 2).sum()
    if total == 0:
        return 0.0
    between = sum((labels == c).sum() * (lengths[labels == c].mean() - lengths.mean()) ** 2 for c in set(records.labels))
    return float(between / total)


def choose_max_length(sequences: list[str], model_limit: int, percentile: float = 98, special_tokens: int = 2,
                      multiple: int = 8) -> tuple[int, int]:
    """A token length covering `percentile` % of the sequences (95-99 is sensible), rounded up to a
    multiple of 8 and capped by the model's limit; returns (max_length, sequences truncated)."""
    import numpy as np

    lengths = np.array([len(s) for s in sequences])
    wanted = int(np.ceil(np.percentile(lengths, percentile))) + special_tokens
    max_length = min(model_limit, -(-wanted // multiple) * multiple)
    truncated = int((lengths + special_tokens > max_length).sum())
    return max_length, truncated


def generate_rna_families(n_per_class: int = 150, n_classes: int = 4, seed: int = 0, min_len: int = 40,
                          max_len: int = 140, families_seed: int = 1234) -> Records:
    """Synthetic RNA "families" for a quick run: each class has its own motifs (planted 4-6 times)
    and its own base composition (a dominant and a secondary base). As in real files, some records use T instead of U, some are
    lower-case and some hold N; labels are family names. Returns raw, uncleaned records.

    `families_seed` defines the families (motifs, biases); `seed` draws the sequences, so a test
    set is the same families with another `seed`.
    """
    definitions = random.Random(families_seed)
    bases = "ACGU"
    motifs = [["".join(definitions.choice(bases) for _ in range(8)) for _ in range(2)] for _ in range(n_classes)]
    # Each family leans towards its own (dominant, secondary) pair of bases; drawn at random,
    # two families' compositions can nearly coincide and only the motifs would tell them apart.
    biases = []
    for k in range(n_classes):
        weights = [1.0] * 4
        weights[k % 4] += 2.5
        weights[(k + 1 + k // 4) % 4] += 1.0
        biases.append(weights)
    rng = random.Random(seed)
    records = Records([], [], f"generated RNA families (seed {seed})")
    for k in range(n_classes):
        for i in range(n_per_class):
            length = rng.randint(min_len, max_len)
            seq = rng.choices(bases, weights=biases[k], k=length)
            for _ in range(rng.randint(4, 6)):
                motif = rng.choice(motifs[k])
                at = rng.randint(0, length - len(motif))
                seq[at:at + len(motif)] = motif
            text = "".join(seq)
            roll = rng.random()
            if roll < 0.2:
                text = text.replace("U", "T")  # a DNA-alphabet record
            elif roll < 0.3:
                text = text.lower()
            if rng.random() < 0.1:
                at = rng.randrange(length)
                text = text[:at] + "N" + text[at + 1:]
            records.sequences.append(text)
            records.labels.append(f"family_{chr(ord('A') + k)}")
            records.lines.append(0)
            records.names.append(f"fam{k}_{i}")
    order = list(range(len(records)))
    rng.shuffle(order)
    return records.subset(order)


def stratified_split(labels: list[str], fraction: float = 0.1, seed: int = 0) -> tuple[list[int], list[int]]:
    """(train, validation) indices, stratified by label where every label has 2+ examples."""
    from sklearn.model_selection import train_test_split

    indices = list(range(len(labels)))
    counts = collections.Counter(labels)
    stratify = labels if min(counts.values()) >= 2 else None
    train, val = train_test_split(indices, test_size=fraction, random_state=seed, stratify=stratify)
    return sorted(train), sorted(val)


@dataclass
class Splits:
    """What a notebook trains, validates and tests on, cleaned; `test_dedup` leaves out the test
    sequences that also occur in the training data (`seen`, one flag per test sequence)."""

    train_all: Records
    train: Records
    validation: Records
    test: Records
    test_dedup: Records
    seen: list[bool]
    labels: list[str]

    @property
    def label2id(self) -> dict[str, int]:
        return {label: i for i, label in enumerate(self.labels)}

    @property
    def id2label(self) -> dict[int, str]:
        return dict(enumerate(self.labels))

    def describe(self) -> str:
        seen = sum(self.seen)
        return (f"{len(self.train)} training, {len(self.validation)} validation, {len(self.test)} test sequences; "
                f"{len(self.labels)} classes\n{seen} test sequences ({seen / max(1, len(self.test)):.1%}) also occur "
                f"in the training data; the de-duplicated test set has {len(self.test_dedup)}")


def prepare_splits(raw_train: Records, raw_test: Records, *, validation: float = 0.1, seed: int = 0,
                   verbose: bool = True) -> Splits:
    """Clean both sets (with a report each), check that every test label occurs in training, split
    validation off the training data only (stratified, seeded) and set the de-duplicated test set aside.

    Raises:
        RnaDataError: a test label never occurs in training (named, with its line).
    """
    train_all, report = clean_records(raw_train)
    if verbose:
        print("training data:", report)
    test, report = clean_records(raw_test)
    if verbose:
        print("test data:", report)
    check_test_labels(train_all, test)
    train_idx, val_idx = stratified_split(train_all.labels, fraction=validation, seed=seed)
    seen = seen_in_training(train_all, test)
    splits = Splits(train_all=train_all, train=train_all.subset(train_idx), validation=train_all.subset(val_idx),
                    test=test, test_dedup=test.subset(i for i, duplicate in enumerate(seen) if not duplicate),
                    seen=seen, labels=sorted(set(train_all.labels)))
    if verbose:
        print(splits.describe())
    return splits
