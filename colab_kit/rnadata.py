"""RNA sequence data: reading, cleaning, lengths, splits, generated families and metrics.

Everything here works on strings and labels, without torch or transformers; tokens and models
are in `colab_kit.rna`, which also re-exports these names (`rna.read_sequences`, ...).
"""

from __future__ import annotations

import collections
import csv
import hashlib
import io
import os
import random
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ColabKitError

__all__ = ["RnaDataError", "Records", "CleaningReport", "read_sequences", "clean_records", "check_test_labels",
           "seen_in_training", "length_stats", "choose_max_length", "generate_rna_families", "stratified_split",
           "classification_metrics", "length_label_association", "download_path", "NUCLEOTIDES"]

NUCLEOTIDES = "ACGUNRYKMSWBDHV"  # U for T; IUPAC ambiguity codes are kept
FASTA_SUFFIXES = {".fa", ".fasta", ".fna", ".ffn", ".frn", ".fas"}


class RnaDataError(ColabKitError, ValueError):
    """A data file cannot be used; the message names the file, the record and the line."""


@dataclass
class Records:
    """Sequences with labels, and where each came from (file, line) for error messages."""

    sequences: list[str]
    labels: list[str]
    source: str
    lines: list[int] = field(default_factory=list)
    names: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.sequences)

    def subset(self, indices) -> "Records":
        pick = list(indices)
        return Records([self.sequences[i] for i in pick], [self.labels[i] for i in pick], self.source,
                       [self.lines[i] for i in pick] if self.lines else [],
                       [self.names[i] for i in pick] if self.names else [])


def download_path(url: str) -> Path:
    """Where a download of `url` is kept: `$XDG_CACHE_HOME/colab_kit/data/` (`~/.cache` when unset, the
    convention Hugging Face's caches follow too), under a name that keeps the file's own."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    name = url.rstrip("/").rsplit("/", 1)[-1] or "data"
    return root / "colab_kit" / "data" / f"{hashlib.sha256(url.encode()).hexdigest()[:12]}-{name}"


def _fetch(source: str) -> Path:
    """A local path for `source`: itself, or a cached download of a URL."""
    if "://" not in source:
        path = Path(source).expanduser()
        if not path.is_file():
            raise RnaDataError(f"{source}: no such file. Give a local path, a Drive path such as "
                               f"/content/drive/MyDrive/data/train.fasta, or an http(s) URL")
        return path
    target = download_path(source)
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            with urllib.request.urlopen(source, timeout=60) as response:
                data = response.read()
        except OSError as exc:
            raise RnaDataError(f"could not download {source}: {exc}. Check the address and the network, or "
                               f"download the file yourself and give its path") from exc
        tmp = target.with_suffix(target.suffix + ".part")
        tmp.write_bytes(data)
        tmp.replace(target)
    return target


def _text(path: Path, source: str) -> str:
    data = path.read_bytes()
    if b"\x00" in data[:65536]:
        raise RnaDataError(f"{source} is not a text file (it holds binary data); give a FASTA file or a "
                           f"CSV/TSV file with 'sequence' and 'label' columns")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise RnaDataError(f"{source} is not a UTF-8 text file (byte {exc.start} cannot be read); give a FASTA "
                           f"file or a CSV/TSV file with 'sequence' and 'label' columns") from None


def _read_fasta(text: str, source: str) -> Records:
    records = Records([], [], source)
    header = None
    header_line = 0
    chunks: list[str] = []

    def close_record():
        sequence = "".join(chunks)
        if not sequence.strip():
            raise RnaDataError(f"{source}, line {header_line}: record '{header}' has an empty sequence")
        words = header.split()
        if len(words) < 2:
            raise RnaDataError(f"{source}, line {header_line}: record '{header}' has no label; the label is the "
                               f"last word of the header, as in '>RF00001_AF095839 5S_rRNA'")
        records.sequences.append(sequence)
        records.labels.append(words[-1])
        records.lines.append(header_line)
        records.names.append(words[0])

    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith(">"):
            if header is not None:
                close_record()
            header, header_line, chunks = line[1:].strip(), number, []
        elif line.strip():
            if header is None:
                raise RnaDataError(f"{source}, line {number}: sequence data before the first '>' header; a FASTA "
                                   f"record starts with a line like '>name label'")
            chunks.append(line)
    if header is None:
        raise RnaDataError(f"{source}: no FASTA records found (no line starts with '>')")
    close_record()
    return records


def _read_table(text: str, source: str) -> Records:
    first = text.splitlines()[0] if text.strip() else ""
    delimiter = "\t" if first.count("\t") > first.count(",") else ","
    reader = csv.DictReader(io.StringIO(text), delimiter=delimiter)
    columns = [c.strip().lower() for c in (reader.fieldnames or [])]
    aliases = {"sequence": ("sequence", "seq", "sequences"), "label": ("label", "labels", "class", "family")}
    found = {}
    for want, names in aliases.items():
        match = [c for c in reader.fieldnames or [] if c.strip().lower() in names]
        if not match:
            raise RnaDataError(f"{source}: no '{want}' column (columns found: {', '.join(columns) or 'none'}); a "
                               f"table needs 'sequence' and 'label' columns, or give a FASTA file")
        found[want] = match[0]
    records = Records([], [], source)
    for number, row in enumerate(reader, start=2):
        sequence = (row.get(found["sequence"]) or "").strip()
        label = (row.get(found["label"]) or "").strip()
        if not sequence:
            raise RnaDataError(f"{source}, line {number}: empty sequence")
        if not label:
            raise RnaDataError(f"{source}, line {number}: missing label")
        records.sequences.append(sequence)
        records.labels.append(label)
        records.lines.append(number)
        records.names.append(f"row {number}")
    if not records.sequences:
        raise RnaDataError(f"{source}: the table has a header but no rows")
    return records


def read_sequences(source: str | Path) -> Records:
    """Read labelled sequences from a FASTA file (label = last word of the header) or a CSV/TSV
    file with `sequence` and `label` columns; `source` is a path, a Drive path or a URL.

    Raises:
        RnaDataError: naming the file, the record and the line of the first problem.
    """
    source = str(source)
    path = _fetch(source)
    text = _text(path, source)
    if not text.strip():
        raise RnaDataError(f"{source} is empty")
    is_fasta = path.suffix.lower() in FASTA_SUFFIXES or text.lstrip().startswith(">")
    return _read_fasta(text, source) if is_fasta else _read_table(text, source)


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


def classification_metrics(y_true: list[str], y_pred: list[str], labels: list[str]) -> dict:
    """Accuracy, macro-F1, Matthews correlation, a per-class report and the confusion matrix."""
    from sklearn.metrics import (accuracy_score, classification_report, confusion_matrix, f1_score,
                                 matthews_corrcoef)

    return {
        "n": len(y_true),
        "accuracy": float(accuracy_score(y_true, y_pred)),
        "macro_f1": float(f1_score(y_true, y_pred, labels=labels, average="macro", zero_division=0)),
        "mcc": float(matthews_corrcoef(y_true, y_pred)),
        "per_class": classification_report(y_true, y_pred, labels=labels, output_dict=True, zero_division=0),
        "confusion": confusion_matrix(y_true, y_pred, labels=labels).tolist(),
        "labels": list(labels),
    }
