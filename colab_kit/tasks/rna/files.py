"""RNA sequence files: FASTA or CSV/TSV, local, on Drive or at a URL, read into `Records` with the
line of every record, so that a bad file stops with a message naming the file, the record and the line.
"""

from __future__ import annotations

import csv
import hashlib
import io
import os
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import ColabKitError

__all__ = ["NUCLEOTIDES", "RnaDataError", "Records", "download_path", "read_sequences"]

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
