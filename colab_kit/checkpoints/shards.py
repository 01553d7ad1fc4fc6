"""Sharded checkpoints (torch.distributed.checkpoint, "DCP"): which files make one complete.

A DCP save writes each rank's shards to its own `__<rank>_<n>.distcp` files, then rank 0 writes
`.metadata` (a dotfile, renamed into place) once every rank has finished; `.metadata` names every
file a load needs. The HF Trainer's FSDP checkpoints hold such folders (`pytorch_model_fsdp_0/`,
`optimizer_0/`), and `CheckpointStore` writes one (`shards/`) for a sharded model.

A checkpoint that lacks one rank's shard or the `.metadata` cannot be loaded, and on several machines
each machine's ranks write to that machine's disk, so rank 0's folder lacks the others' shards. So the
kit checks a checkpoint before it is published (`record`, reading `.metadata` that this run's ranks
just wrote, as DCP's own load reads it) and writes down in its manifest which files each DCP folder
needs. Every later check (`layout_problem`) reads only that JSON: a manifest whose DCP folder has no
`.metadata`, or lacks a file its record names, is incomplete on positive evidence, never valid.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from . import storage

__all__ = ["METADATA", "SHARD_SUFFIX", "IncompleteShards", "record", "layout_problem"]

METADATA = ".metadata"
SHARD_SUFFIX = ".distcp"


class IncompleteShards(Exception):
    """A sharded checkpoint on local disk lacks its `.metadata` or a file the `.metadata` names."""


def _dcp_folders(names) -> list[str]:
    """The folders (relative POSIX paths, "." for the top) among `names` that hold DCP files."""
    folders = set()
    for name in names:
        path = PurePosixPath(name)
        if path.name == METADATA or path.suffix == SHARD_SUFFIX:
            folders.add(path.parent.as_posix())
    return sorted(folders)


def _join(folder: str, name: str) -> str:
    return name if folder == "." else f"{folder}/{name}"


def _needed(dcp_folder: Path) -> set[str]:
    """The files `.metadata` names (DCP's own reader: it unpickles, as every DCP load does)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(dcp_folder)).read_metadata()
    return {info.relative_path for info in metadata.storage_data.values()}


def record(folder: str | Path) -> dict[str, list[str]]:
    """Which files each DCP folder of the checkpoint `folder` needs ({} when it has none).

    Raises:
        IncompleteShards: a DCP folder has no `.metadata`, or lacks a file it names (with a message that
            says why that happens and what to do).
        OSError: a file could not be read (nothing is known).
    """
    folder = Path(folder)
    names = {p.relative_to(folder).as_posix() for p in storage.files_under(folder)
             if not storage.is_temp_name(p.name)}
    shards: dict[str, list[str]] = {}
    for sub in _dcp_folders(names):
        if _join(sub, METADATA) not in names:
            raise IncompleteShards(f"{_join(sub, '')}{METADATA} is missing beside the shard files: the sharded save "
                                   f"(torch.distributed.checkpoint) did not finish on every rank")
        try:
            needed = sorted(_needed(folder / sub))
        except OSError:
            raise
        except Exception as exc:  # noqa: BLE001 - a torn or foreign .metadata: DCP could not load it either
            raise IncompleteShards(f"{_join(sub, METADATA)} cannot be read as DCP metadata "
                                   f"({type(exc).__name__}: {exc})") from exc
        missing = [name for name in needed if _join(sub, name) not in names]
        if missing:
            raise IncompleteShards(
                f"{_join(sub, '')} lacks {', '.join(missing)}, which its {METADATA} names: another rank's shards "
                f"are not in this folder. On several machines each machine's ranks write to that machine's own "
                f"disk, and the kit mirrors one folder, rank 0's; a sharded checkpoint spread over several disks "
                f"is not published. Train on one machine, or give every rank one shared output folder")
        shards[sub] = needed
    return shards


def layout_problem(files, shards: dict[str, list[str]]) -> str | None:
    """Why a manifest listing `files` (relative names) with the shard record `shards` cannot be a complete
    sharded checkpoint; None when it can (or holds no DCP folder). Reads nothing but the manifest."""
    files = set(files)
    for sub in _dcp_folders(files):
        if _join(sub, METADATA) not in files:
            return f"its manifest lists shard files in {sub} but no {METADATA} (an incomplete sharded save)"
    for sub, needed in shards.items():
        missing = [name for name in needed if _join(sub, name) not in files]
        if missing:
            return f"its manifest lacks {', '.join(_join(sub, n) for n in missing)}, which {sub}/{METADATA} needs"
    return None
