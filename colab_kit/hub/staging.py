"""Where the replica's filling downloads before a folder moves in (`fill.py`), and the moves themselves.

A folder that showed up in the replica half-filled would look like a checkpoint whose upload never ended, which
the gate may delete (issue 38): each file is downloaded into a staging folder beside the replica, checked there,
and the folder moves into the replica with one rename.
"""

from __future__ import annotations

from itertools import count
from pathlib import Path

from ..checkpoints import storage
from ..checkpoints.manifest import MANIFEST
from .verify import git_blob_id

__all__ = ["staging_folder", "sweep", "verify", "place"]

_made = count()  # each filling its own staging folder: a stopped one's last download never lands in the next's


def staging_folder(replica: Path, pid: int) -> Path:
    return replica.parent / f".fill-{replica.name}-{pid}-{next(_made)}"


def sweep(replica: Path) -> None:
    """Remove the staging folders an earlier start left (a kernel restart, a stopped filling)."""
    prefix = f".fill-{replica.name}-"
    try:
        stale = [entry.path for entry in storage.list_dir(replica.parent) if entry.name.startswith(prefix)]
    except FileNotFoundError:
        return
    for path in stale:
        storage.remove_tree(path)


def verify(local: Path, path: str, *, sha256: str | None, blob_id: str | None) -> None:
    """The file downloaded to `local` holds the bytes the Hub lists for `path` (its LFS sha256, else a small git
    file's blob id): the client checks a download's size only. Hashed in chunks right after it landed (the page
    cache holds it), not while streaming: `hf_hub_download` owns the stream and its resumes and retries.

    Raises:
        OSError: it does not (the file is removed; the filling fetches it again later)."""
    if sha256 is not None:
        if storage.sha256_file(local) != sha256:
            storage.unlink(local)
            raise OSError(f"{path} as downloaded does not hold the bytes the Hub lists (sha256): fetched again later")
    elif blob_id is not None and git_blob_id(storage.read_bytes(local)) != blob_id:
        storage.unlink(local)
        raise OSError(f"{path} as downloaded is not the file the Hub lists: fetched again later")


def place(store, key: str, staging: Path, paths: list[str], *, folder: str | None) -> None:
    """Move what was downloaded for folder `key` of the run (`paths` in the repo, under `staging` as they lie in
    the repo) into `store`'s replica. A folder the replica lacks moves in with one rename (`folder`: its path in
    the repo; None for the run folder's own files), else file by file, a manifest last (it names the rest); the
    journal is merged, never replaced (the replica's may be newer)."""
    target = store.replica / key
    if folder is not None and not storage.exists(target):
        storage.make_dirs(target.parent)
        storage.replace(staging / folder, target)
        return
    for path in sorted(paths, key=lambda p: p.endswith(f"/{MANIFEST}")):
        local = store.replica / store._relative(path)
        storage.make_dirs(local.parent)
        if path == store._journal_path and storage.exists(local):
            store._merge_journal(staging / path, local)
        else:
            storage.replace(staging / path, local)
