"""One Hub repo, through the real `huggingface_hub` client, with the answers the durability core needs.

Every write is a commit made with `parent_commit` (the Hub's compare-and-swap): it lands only on the head
it was prepared on, so a runtime that checked its lease at that head knows no other runtime took the run
over in between (`lease.py`). What a flaky network makes of a commit is sorted out here:

- 429 (rate limit) and 5xx: backed off (Retry-After when the Hub gives one) and tried again;
- an answer that never came (a timeout, a dropped connection, a 5xx after the Hub did the work): the
  commit may have landed. Each commit carries a unique mark in its description, so the history since its
  parent is read for the mark: found, the commit is taken as made (never made twice); not found and the head
  unmoved, it is tried again; the head moved, `HeadMoved` (the caller checks its lease at the new head);
- 412 (the head moved before the commit): `HeadMoved`, also after looking for the mark (the timed-out
  first try may be the commit that moved it).

A read that fails is *unknown* (`HubUnavailable`, an OSError, as Drive trouble is): it costs time, never a
deletion or a claim. Files missing from a listing are not taken for absent here either; `verify.py` says
only what a listing proves.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..checkpoints import storage
from ..checkpoints.clock import Late, clock
from .address import HubAddress
from .client import no_answer, no_progress_bars, quiet_client_log, require_client, retry_after, status_of

__all__ = ["HubRepo", "HubFile", "HeadMoved", "HubUnavailable", "MARK"]

log = logging.getLogger(__name__)
MARK = "colab_kit-commit:"  # then a unique id, in every commit's description


class HubUnavailable(OSError):
    """The Hub did not answer (or answered 429/5xx) after the retries: unknown, try again later."""


class HeadMoved(Exception):
    """The branch's head is not the commit this one was prepared on: another writer committed first."""

    def __init__(self, head: str | None):
        super().__init__(f"the Hub repo's head moved to {head}")
        self.head = head


@dataclass(frozen=True)
class HubFile:
    """One file as a tree listing shows it: `sha256` is the LFS object's (the content's own hash), None for a
    file kept in git."""

    path: str
    size: int
    sha256: str | None
    blob_id: str


def _size(src) -> int:
    return len(src) if isinstance(src, (bytes, bytearray)) else storage.stat(src).st_size


class HubRepo:
    """A repo of the Hub, read and written for one runtime.

    Args:
        address: the store's `HubAddress`.
        token: a token with write access (`token.find_token`, on the main thread).
        endpoint: the Hub's address (the tests' emulated Hub; default huggingface.co or $HF_ENDPOINT).
        waits: the pauses between tries of one call (then `HubUnavailable`).
        commit_wait: (seconds, bytes per second): a commit's answer is waited for that long plus its bytes at
            that rate (its LFS uploads happen inside it), then taken for lost (the client itself waits forever).
        read_wait: seconds a read is waited for (the client gives most of its calls no timeout).
    """

    def __init__(self, address: HubAddress, token: str, *, endpoint: str | None = None,
                 waits: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0), commit_wait: tuple[float, float] = (60.0, 1e6),
                 read_wait: float = 60.0):
        require_client()
        from huggingface_hub import HfApi

        self.address, self.waits, self.commit_wait, self.read_wait = address, waits, commit_wait, read_wait
        self.api = HfApi(endpoint=endpoint, token=token)
        self.on_wait: Callable[[str], None] | None = None  # told each wait before a try again (start_run says it)
        self._sending = 0  # commit tries still running (one whose answer was waited for no longer may go on)
        self._sending_lock = threading.Lock()
        quiet_client_log()

    # -- reads -------------------------------------------------------------------------------------------
    def create(self) -> None:
        """Make the repo (private) unless it exists."""
        self._patiently(lambda: self.api.create_repo(self.address.repo_id, repo_type=self.address.repo_type,
                                                     private=True, exist_ok=True), "create the repo")

    def head(self) -> str:
        """The commit at the top of `main`."""
        info = self._patiently(lambda: self.api.repo_info(self.address.repo_id, repo_type=self.address.repo_type),
                               "read the repo's head")
        return info.sha

    def listing(self, folder: str, revision: str | None = None) -> dict[str, HubFile]:
        """Every file under `folder` at `revision` (default: the head), by path in the repo. Nothing for a folder
        that does not exist at that revision (the Hub answers 404 for it)."""
        from huggingface_hub.errors import EntryNotFoundError

        def read():
            try:
                entries = list(self.api.list_repo_tree(self.address.repo_id, path_in_repo=folder or None,
                                                       recursive=True, revision=revision,
                                                       repo_type=self.address.repo_type))
            except EntryNotFoundError:
                return {}
            return {e.path: HubFile(e.path, int(e.size), e.lfs.sha256 if e.lfs else None, e.blob_id)
                    for e in entries if hasattr(e, "blob_id")}

        return self._patiently(read, f"list {folder or 'the repo'}")

    def read(self, path: str, revision: str | None = None) -> bytes | None:
        """The bytes of `path` at `revision` (None: the Hub answered that the file is not there; a commit's tree
        never changes, so at a pinned revision that answer stands)."""
        from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

        def fetch():
            try:
                with no_progress_bars():
                    return storage.read_bytes(self.api.hf_hub_download(self.address.repo_id, path, revision=revision,
                                                                       repo_type=self.address.repo_type))
            except LocalEntryNotFoundError as exc:  # the Hub did not answer, and nothing is cached: unknown
                raise HubUnavailable(f"cannot read {path} on the Hub: {exc}") from exc
            except EntryNotFoundError:  # the Hub answered 404 (the local kind is caught above: it subclasses it)
                return None

        return self._patiently(fetch, f"read {path}")

    def download(self, paths: list[str], dest: Path, revision: str) -> None:
        """Download `paths` (at `revision`, so that they are one checkpoint's) into `dest`, keeping their layout
        under the address's folder. A stalled transfer ends at the client's read timeout and is tried again
        (the client resumes a partial file)."""
        def fetch(path):
            with no_progress_bars():
                return self.api.hf_hub_download(self.address.repo_id, path, revision=revision,
                                                repo_type=self.address.repo_type, local_dir=dest)

        for path in paths:
            self._patiently(lambda: fetch(path), f"download {path}", wait=None)  # the client's read timeout bounds it

    def commits_since(self, parent: str) -> list:
        """The commits on `main` after `parent`, newest first (all of them when `parent` is not in the history)."""
        commits = self._patiently(lambda: self.api.list_repo_commits(self.address.repo_id,
                                                                     repo_type=self.address.repo_type),
                                  "read the repo's history")
        since = []
        for commit in commits:
            if commit.commit_id == parent:
                break
            since.append(commit)
        return since

    # -- writes ------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def uploaded(self, add: dict[str, str | Path | bytes]):
        """The data of a commit sent before the commit (`commit(..., sent=...)`): yields its operations, the LFS
        files among them already on the Hub, their files open until the commit is made.

        A commit only names blobs; sending them is most of its time (a 1 GB checkpoint at the few MB/s Colab
        uploads: minutes). Sent here, outside the lease's lock, they keep no other commit waiting: the lease's
        heartbeat goes on beating while a checkpoint uploads. A blob no commit names changes nothing in the repo.

        Raises:
            HubUnavailable: a file could not be sent after the retries (nothing was committed).
        """
        from huggingface_hub import CommitOperationAdd

        seconds, rate = self.commit_wait
        with contextlib.ExitStack() as files:
            operations = [CommitOperationAdd(path_in_repo=p, path_or_fileobj=files.enter_context(storage.open_read(src))
                                             if isinstance(src, Path) else src) for p, src in add.items()]
            for operation in operations:
                def send(operation=operation):
                    with no_progress_bars():
                        self.api.preupload_lfs_files(self.address.repo_id, [operation], repo_type=self.address.repo_type)

                self._patiently(send, f"upload {operation.path_in_repo}",
                                wait=seconds + operation.upload_info.size / rate)
            yield operations

    def commit(self, message: str, *, parent: str, add: dict[str, str | Path | bytes] | None = None,
               delete: list[str] = (), sent: list = ()) -> str:
        """One commit on `parent`: `add` (path in the repo -> a local file or bytes), `sent` (operations from
        `uploaded`, their data on the Hub already) and `delete` (paths; a path ending in "/" is a folder).
        Returns the new head.

        Raises:
            HeadMoved: `main` is no longer at `parent` (and this commit is not the one that moved it).
            HubUnavailable: no answer after the retries (the mark was looked for: the commit is not there).
        """
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete

        mark = f"{MARK} {uuid.uuid4().hex}"  # the same in every try: a try that lands late is recognised
        seconds, rate = self.commit_wait
        patience = seconds + sum(_size(src) for src in (add or {}).values()) / rate

        with self._sending_lock:
            if self._sending:
                raise HubUnavailable("an earlier commit is still on its way to the Hub (its answer was waited for no "
                                     "longer): nothing more is sent until it ends")

        def send():  # new operation objects each try: the client marks them
            with self._sending_lock:
                self._sending += 1
            try:
                return attempt()
            finally:
                with self._sending_lock:
                    self._sending -= 1

        def attempt():
            with contextlib.ExitStack() as files, no_progress_bars():
                adds = [CommitOperationAdd(path_in_repo=p, path_or_fileobj=files.enter_context(storage.open_read(src))
                                           if isinstance(src, Path) else src) for p, src in (add or {}).items()]
                for operation in adds:
                    self.api.preupload_lfs_files(self.address.repo_id, [operation], repo_type=self.address.repo_type)
                # `sent` are reused across tries: the client marks an operation committed only once it landed.
                operations = [*sent, *adds] + [CommitOperationDelete(path_in_repo=p) for p in delete]
                return self.api.create_commit(self.address.repo_id, operations, commit_message=message,
                                              commit_description=mark, parent_commit=parent,
                                              repo_type=self.address.repo_type).oid

        for wait in (*self.waits, None):
            try:
                return clock.within(patience, send, name="colab_kit-hub-commit")
            except Exception as exc:  # noqa: BLE001 - sorted below; what is not the Hub's trouble is raised
                status = status_of(exc)
                if status != 412 and not isinstance(exc, Late) and not no_answer(exc):
                    raise
                landed = self._find_mark(mark, parent)  # it may have landed all the same
                if landed is not None:
                    log.info("a commit whose answer was lost had landed: %s", landed)
                    return landed
                if status == 412:
                    raise HeadMoved(self._head_or_none()) from exc
                head = self._head_or_none()
                if head is not None and head != parent:
                    raise HeadMoved(head) from exc
                if wait is None or self._sending:  # never a second upload beside one still running
                    raise HubUnavailable(f"the Hub did not take a commit ({message}) now: {exc}") from exc
                wait = retry_after(exc) or wait
                self._waiting(f"the Hub did not take a commit ({message}): {_brief(exc)}; trying again in {wait:.0f} s")
                clock.sleep(wait)
        raise AssertionError("unreachable")

    # -- helpers -----------------------------------------------------------------------------------------
    def _waiting(self, text: str) -> None:
        log.info("%s", text)
        if self.on_wait is not None:
            self.on_wait(text)

    def _find_mark(self, mark: str, parent: str) -> str | None:
        try:
            for commit in self.commits_since(parent):
                if mark in (commit.message or ""):
                    return commit.commit_id
        except HubUnavailable:
            return None  # unknown: the caller's own retry looks again
        return None

    def _head_or_none(self) -> str | None:
        try:
            return self.head()
        except HubUnavailable:
            return None

    def _patiently(self, call, what: str, wait: float | None | bool = True):
        """`call()`, waited for `read_wait` seconds at most (`wait=None`: as long as the client takes), tried again
        after 429/5xx and lost answers; `HubUnavailable` once the waits are spent."""
        seconds = self.read_wait if wait is True else wait
        for pause in (*self.waits, None):
            try:
                return clock.within(seconds, call, name="colab_kit-hub-read")
            except Exception as exc:  # noqa: BLE001 - what is not the Hub's trouble is raised as it is
                if not isinstance(exc, Late) and not no_answer(exc):
                    raise
                if pause is None:
                    raise HubUnavailable(f"cannot {what} on the Hub ({self.address}): {exc}") from exc
                pause = retry_after(exc) or pause
                self._waiting(f"cannot {what} on the Hub now ({_brief(exc)}); trying again in {pause:.0f} s")
                clock.sleep(pause)
        raise AssertionError("unreachable")


def _brief(exc: BaseException) -> str:
    """An error in a line: the HTTP status where there is one, else the first line of its message."""
    status = status_of(exc)
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return f"HTTP {status}" if status is not None else text[:120]
