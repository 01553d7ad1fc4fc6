"""MANIFEST.json: the small file, written last, that makes a checkpoint folder exist.

A checkpoint folder without a manifest that verifies does not exist as far as resume is
concerned: the data files are written first, the manifest (their sizes and sha256) last and
atomically, so a kill at any moment leaves either no manifest or a complete one. Whether a folder
matches its manifest is decided in one place, `validity.py`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .clock import clock
from ..runtime import KIT_VERSION, library_versions
from . import storage

__all__ = ["MANIFEST", "Manifest", "FileEntry", "hash_folder", "parse_manifest", "read_manifest", "write_manifest"]

MANIFEST = "MANIFEST.json"
_FORMAT = 1


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str
    md5: str = ""  # what Drive reports as the file's checksum (md5Checksum, user.drive.md5)


@dataclass
class Manifest:
    """What a checkpoint folder holds, and what made it."""

    step: int
    files: dict[str, FileEntry]
    fingerprint: dict = field(default_factory=dict)
    created: float = field(default_factory=clock.time)
    kit_version: str = KIT_VERSION  # the kit that wrote it
    kit_state: dict = field(default_factory=dict)  # the training clock (one file fewer to upload)
    format: int = _FORMAT
    shards: dict = field(default_factory=dict)  # DCP folder -> the files its .metadata needs (`shards.py`)
    versions: dict = field(default_factory=library_versions)  # what wrote it: torch, transformers, CUDA, the GPU...

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.files.values())

    def to_json(self) -> dict:
        # By hand: `asdict` deep-copies every value, and manifests are written for every checkpoint.
        obj = {"step": self.step, "files": {name: {"size": e.size, "sha256": e.sha256, "md5": e.md5}
                                            for name, e in self.files.items()},
               "fingerprint": dict(self.fingerprint), "created": self.created, "kit_version": self.kit_version,
               "kit_state": dict(self.kit_state), "format": self.format}
        if self.shards:  # only sharded checkpoints carry it
            obj["shards"] = {folder: list(names) for folder, names in self.shards.items()}
        if self.versions:
            obj["versions"] = dict(self.versions)
        return obj

    @classmethod
    def from_json(cls, obj: dict) -> "Manifest":
        files = {name: FileEntry(int(e["size"]), str(e["sha256"]), str(e.get("md5", "")))
                 for name, e in obj["files"].items()}
        return cls(step=int(obj["step"]), files=files, fingerprint=dict(obj.get("fingerprint") or {}),
                   created=float(obj.get("created", 0.0)), kit_version=str(obj.get("kit_version", "")),
                   kit_state=dict(obj.get("kit_state") or {}), format=int(obj.get("format", _FORMAT)),
                   shards=_shards(obj.get("shards") or {}), versions=_versions(obj.get("versions") or {}))


def _shards(obj) -> dict[str, list[str]]:
    if not isinstance(obj, dict) or not all(isinstance(v, list) for v in obj.values()):
        raise TypeError(f"shards is not a mapping of folders to file lists: {obj!r:.80}")
    return {str(folder): [str(name) for name in names] for folder, names in obj.items()}


def _versions(obj) -> dict[str, str]:
    if not isinstance(obj, dict):
        raise TypeError(f"versions is not a mapping: {obj!r:.80}")
    return {str(name): str(value) for name, value in obj.items()}


def _data_files(folder: Path) -> list[Path]:
    return [p for p in storage.files_under(folder) if p.name != MANIFEST and not storage.is_temp_name(p.name)]


def hash_folder(folder: str | Path) -> dict[str, FileEntry]:
    """Size, sha256 and md5 of every data file in `folder` (relative POSIX names)."""
    folder = Path(folder)
    return {p.relative_to(folder).as_posix(): FileEntry(storage.stat(p).st_size, *storage.file_digests(p))
            for p in _data_files(folder)}


def write_manifest(folder: str | Path, manifest: Manifest) -> None:
    """Write MANIFEST.json atomically (call only after every data file is durable)."""
    storage.atomic_write_json(Path(folder) / MANIFEST, manifest.to_json())


def parse_manifest(raw: bytes | None) -> Manifest | None:
    """The manifest in `raw` (a MANIFEST.json's bytes), or None when there is none or it does not parse."""
    if raw is None:
        return None
    try:
        return Manifest.from_json(json.loads(raw))
    except (ValueError, KeyError, TypeError):
        return None


def read_manifest(folder: str | Path) -> Manifest:
    """Parse a folder's manifest (whether the folder matches it is `validity.check`'s question).

    Raises:
        ValueError: no manifest, or one that does not parse, with the reason.
        OSError: the manifest could not be read (nothing is known).
    """
    path = Path(folder) / MANIFEST
    try:
        raw = storage.read_bytes(path)
    except FileNotFoundError:
        raise ValueError("no MANIFEST.json (the save or upload did not finish)") from None
    try:
        return Manifest.from_json(json.loads(raw))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"unreadable MANIFEST.json ({exc})") from None
