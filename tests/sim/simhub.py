"""The Hugging Face Hub of the simulator's Hub world: the emulated Hub's state (`hub_state.HubState`: a linear
history of full snapshots, LFS objects by sha256, `parentCommit` compared and swapped) behind the few `HfApi`
methods the kit's `HubRepo` calls, on the world's virtual clock, with faults drawn from the world's rng:

  fail     a request answered 5xx or 429 (or no answer at all: a timeout)
  lost     a commit applied whose answer never comes (the client sees a timeout)
  hide     a tree listing that misses a checkpoint file
  down     for a while, nothing answers (the world's errno-107 windows)
  cdn      for a while, downloads fail while the API answers (the world's Drive-API outages)
  limit    for a while, every commit is answered 429 with the time to the window's reset (the Hub's commits per
           repo; uploads and reads go on)
  slow     LFS uploads at `upload_bps`: a checkpoint's commit can take longer than a lease's watch window (the
           data is sent first, `HubRepo.uploaded`; the runtime's heartbeat, a thread of its own, goes on meanwhile)

Files the kit downloads are written to the VM's local disk through `storage` (the world's in-memory one).
"""

from __future__ import annotations

import base64
import hashlib
import io
from pathlib import Path
from types import SimpleNamespace

from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError
from hub_state import BRANCH, HubError, HubState, list_tree

from colab_kit.checkpoints import storage

__all__ = ["SimHub", "HubFaultRates"]


_SMALL = 1024  # bytes: a lease, a mark or a journal line is sent at once, a checkpoint's file at `upload_bps`


class _Answer(Exception):
    """An HTTP error answer, shaped as the client's: `.response.status_code`."""

    def __init__(self, status: int, text: str = ""):
        super().__init__(f"{status} {text}")
        self.response = SimpleNamespace(status_code=status, headers={})


class _Missing(EntryNotFoundError):
    """The Hub's 404 for a file (the client's RemoteEntryNotFoundError is an EntryNotFoundError too)."""


class HubFaultRates(SimpleNamespace):
    def __init__(self, fail: float = 0.0, lost: float = 0.0, hide: float = 0.0):
        super().__init__(fail=fail, lost=lost, hide=hide)


class SimHub:
    """The `HfApi` of every runtime of the Hub world (one Hub; each runtime's `HubRepo` gets it as `.api`)."""

    def __init__(self, world, rates: HubFaultRates, cache_root: Path):
        self.w, self.rates, self.cache_root = world, rates, cache_root
        self.state = HubState()
        self.down_until = self.downloads_down_until = -1.0
        self.hidden_until = -1.0  # a listing misses a file until then (the world's "hide" events)
        self.limited: list[tuple[float, float]] = []  # (from, until): commits answered 429 then
        self.upload_bps: float | None = None  # None: uploads take no time
        self.on_commit = None  # (actor, parent files, new files, ops) -> None: the invariants, before it lands
        self.after_commit = None  # (files) -> None
        self.commits = 0

    # -- faults ----------------------------------------------------------------------------------------
    def _weather(self, download: bool = False) -> None:
        """Raise what the client raises when the Hub does not answer now: for a download, after its own retries
        and with nothing cached, LocalEntryNotFoundError (a "not found" that is no answer at all)."""
        failing = (self.w.clock.t < self.down_until or self.w.rng.random() < self.rates.fail
                   or download and self.w.clock.t < self.downloads_down_until)
        if not failing:
            return
        self.w.happened["hub requests failed"] += 1
        if download:
            raise LocalEntryNotFoundError("the Hub did not answer and the file is not in the local cache (simulated)")
        kind = "timeout" if self.w.clock.t < self.down_until else self.w.rng.choice(("503", "500", "429", "timeout"))
        if kind == "timeout":
            raise TimeoutError("timed out (simulated)")
        raise _Answer(int(kind), "simulated")

    def limited_until(self) -> float | None:
        """The end of the spell of 429s for commits under way now (None: commits are taken)."""
        t = self.w.clock.t
        return next((until for start, until in self.limited if start <= t < until), None)

    def refused_between(self, start: float, end: float) -> float:
        """The seconds of [start, end] in which the Hub took no commit from anyone (429 spells, outages)."""
        spells = [(a, b) for a, b in self.limited] + [(a, b) for a, b in self.w.hub_outages]
        covered, last = 0.0, start
        for a, b in sorted(spells):
            a, b = max(a, last), min(b, end)
            if b > a:
                covered, last = covered + b - a, b
        return covered

    def _repo(self, repo_id: str, repo_type):
        try:
            return self.state.get_repo(repo_type or "model", repo_id)
        except HubError as exc:
            raise _Answer(404, str(exc)) from None

    # -- the client's calls -----------------------------------------------------------------------------
    def create_repo(self, repo_id, *, repo_type=None, private=False, exist_ok=False):
        self._weather()
        self.state.create_repo(repo_type or "model", repo_id, private)

    def repo_info(self, repo_id, *, repo_type=None, revision=None):
        self._weather()
        return SimpleNamespace(sha=self._repo(repo_id, repo_type).head.id)

    def list_repo_tree(self, repo_id, path_in_repo=None, *, recursive=False, revision=None, repo_type=None):
        self._weather()
        repo = self._repo(repo_id, repo_type)
        files = self.state.resolve(repo, revision or BRANCH).files
        try:
            entries = list_tree(files, path_in_repo or "", recursive)
        except HubError:
            raise _Missing(f"{path_in_repo} does not exist") from None
        hide = None
        if self.w.clock.t < self.hidden_until or self.w.rng.random() < self.rates.hide:
            names = [p for kind, p in entries if kind == "file" and "/checkpoints/" in p]
            hide = self.w.rng.choice(names) if names else None
            self.w.happened["hub listings missing a file"] += hide is not None
        listed = []
        for kind, path in entries:
            if kind != "file" or path == hide:
                continue
            entry = files[path]
            lfs = SimpleNamespace(sha256=entry.sha256) if entry.sha256 else None
            listed.append(SimpleNamespace(path=path, size=entry.size, blob_id=entry.oid, lfs=lfs))
        return listed

    def list_repo_commits(self, repo_id, *, repo_type=None):
        self._weather()
        history = self._repo(repo_id, repo_type).history
        return [SimpleNamespace(commit_id=c.id, message=c.message, title=c.title) for c in reversed(history)]

    def hf_hub_download(self, repo_id, filename, *, revision=None, repo_type=None, local_dir=None):
        self._weather(download=True)
        files = self.state.resolve(self._repo(repo_id, repo_type), revision or BRANCH).files
        entry = files.get(filename)
        if entry is None:
            raise _Missing(f"{filename} is not at {revision}")
        if local_dir is not None:
            target = Path(local_dir) / filename
        else:
            target = self.cache_root / hashlib.sha256(entry.content).hexdigest()
        storage.make_dirs(target.parent)
        storage.atomic_write_bytes(target, entry.content, durable=False)
        return str(target)

    def preupload_lfs_files(self, repo_id, additions, *, repo_type=None, **_):
        self._weather()
        size = sum(len(_bytes(op.path_or_fileobj)) for op in additions)
        rt = self.w.fs.actor
        if self.upload_bps and size > _SMALL and rt is not None:  # a checkpoint's file: it takes its time
            self.w.happened["hub uploads slower than a watch window"] += size / self.upload_bps > 1.5 * self.w.s.heartbeat_s
            rt.uploading = True
            try:
                self.w.sleep(size / self.upload_bps)
            finally:
                rt.uploading = False
            self._weather()  # the Hub may have gone away meanwhile


    def create_commit(self, repo_id, operations, *, commit_message, commit_description="", parent_commit=None,
                      repo_type=None):
        self._weather()
        repo = self._repo(repo_id, repo_type)
        ops = []
        for op in operations:
            if hasattr(op, "path_or_fileobj"):
                data = _bytes(op.path_or_fileobj)
                if self.state.upload_mode(repo, op.path_in_repo, len(data)) == "lfs":
                    oid = hashlib.sha256(data).hexdigest()
                    self.state.store_lfs_object(oid, data)
                    ops.append(("lfsFile", {"path": op.path_in_repo, "oid": oid}))
                else:
                    ops.append(("file", {"path": op.path_in_repo, "content": base64.b64encode(data).decode()}))
            else:
                folder = op.path_in_repo.endswith("/") or getattr(op, "is_folder", False) is True
                ops.append(("deletedFolder" if folder else "deletedFile", {"path": op.path_in_repo.rstrip("/")}))
        until = self.limited_until()
        if until is not None:
            self.w.happened["hub commits refused by a rate limit"] += 1
            answer = _Answer(429, "simulated: too many commits")
            answer.response.headers = {"Retry-After": str(max(1, int(until - self.w.clock.t + 1)))}
            raise answer
        header = {"summary": commit_message, "description": commit_description or "", "parentCommit": parent_commit}
        before = repo.head.files
        if parent_commit and repo.head.id != parent_commit:
            raise _Answer(412, "A commit has happened since. Please refresh and try again.")
        if self.on_commit is not None:
            after = dict(before)
            for key, value in ops:
                try:
                    self.state._apply(after, key, value)
                except HubError:
                    pass
            self.on_commit(before, after, ops)
        try:
            commit = self.state.commit(repo, BRANCH, header, ops)
        except HubError as exc:
            raise _Answer(exc.status, str(exc)) from None
        self.commits += 1
        if self.after_commit is not None:
            self.after_commit(commit.files)
        if self.w.rng.random() < self.rates.lost:  # landed, and the answer is lost on the way back
            self.w.happened["hub commit answers lost"] += 1
            raise TimeoutError("the commit's answer never came (simulated)")
        return SimpleNamespace(oid=commit.id)


def _bytes(source) -> bytes:
    if isinstance(source, (bytes, bytearray)):
        return bytes(source)
    if isinstance(source, io.IOBase) or hasattr(source, "read"):
        position = source.tell()
        data = source.read()
        source.seek(position)
        return data
    return storage.read_bytes(source)
