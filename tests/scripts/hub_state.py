"""State behind the emulated Hugging Face Hub (see hub_server.py for the HTTP side).

Holds, in memory and behind one lock:
- repos: each a linear history of commits on the single branch ``main``; every commit is a full
  snapshot ``{path: FileEntry}`` (no packfiles, no diffs);
- the LFS object store, keyed by sha256 (shared by all repos: the upload href is a capability);
- the fault plan (``Faults``) that tests arm at runtime;
- a request log with per-endpoint counters, for assertions.

Upload-mode rule (what /preupload answers), mirroring the Hub: a file is LFS when its size is
above ``lfs_threshold`` (10 MiB, the Hub's limit for plain git files) or when its path matches a
``filter=lfs`` pattern of the ``.gitattributes`` at the branch head. ``create_repo`` writes an
initial commit with the Hub's default ``.gitattributes`` (*.safetensors, *.bin, *.pt, ...).
Empty files are always regular (the client forces that too).
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import itertools
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone

LFS_PATTERNS = (
    "*.7z *.arrow *.bin *.bz2 *.ckpt *.ftz *.gz *.h5 *.joblib *.lfs.* *.mlmodel *.model *.msgpack "
    "*.npy *.npz *.onnx *.ot *.parquet *.pb *.pickle *.pkl *.pt *.pth *.rar *.safetensors "
    "saved_model/**/* *.tar.* *.tar *.tflite *.tgz *.wasm *.xz *.zip *.zst *tfevents*"
).split()
DEFAULT_GITATTRIBUTES = "".join(f"{p} filter=lfs diff=lfs merge=lfs -text\n" for p in LFS_PATTERNS).encode()
DEFAULT_LFS_THRESHOLD = 10 * 1024 * 1024
BRANCH = "main"


def git_blob_oid(data: bytes) -> str:
    """The git object id of a blob, as `git hash-object` computes it."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def utc_iso(dt: datetime) -> str:
    # The client's parse_datetime only accepts this exact shape.
    return dt.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


class HubError(Exception):
    """An error answer: HTTP status, optional X-Error-Code (drives the client's exception class)."""

    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}


@dataclass(frozen=True)
class FileEntry:
    content: bytes
    sha256: str | None = None  # set iff the file is stored in LFS

    @property
    def size(self) -> int:
        return len(self.content)

    @property
    def pointer(self) -> bytes | None:
        return lfs_pointer(self.sha256, self.size) if self.sha256 else None

    @property
    def oid(self) -> str:
        # Like git: an LFS file's blob is its pointer file, not its content.
        return git_blob_oid(self.pointer or self.content)


@dataclass(frozen=True)
class Commit:
    id: str
    title: str
    message: str
    date: datetime
    files: dict  # path -> FileEntry (full snapshot; never mutated once committed)


@dataclass
class Repo:
    repo_type: str
    repo_id: str
    private: bool = False
    history: list = field(default_factory=list)  # Commit objects, oldest first

    @property
    def head(self) -> Commit:
        return self.history[-1]


@dataclass
class _Rule:
    """One armed fault: which requests it hits, how many more times, and its parameters."""

    kind: str
    remaining: int
    method: str | None = None
    endpoint: str | None = None
    path: str | None = None  # regex searched in the URL path
    params: dict = field(default_factory=dict)
    until: float | None = None  # a rule for a spell of time (time.monotonic()), not a count

    def matches(self, method: str, endpoint: str, path: str) -> bool:
        return (
            (self.until is None or time.monotonic() < self.until)
            and (self.method is None or self.method.upper() == method)
            and (self.endpoint is None or self.endpoint == endpoint)
            and (self.path is None or re.search(self.path, path) is not None)
        )


class Faults:
    """Fault plan armed by tests at runtime; every method is thread-safe.

    Matching: ``method`` (e.g. "POST"), ``endpoint`` (a name from hub_server.ROUTES, e.g. "commit",
    "resolve", "preupload", "tree") and ``path`` (regex searched in the URL path), all optional.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._rules: list[_Rule] = []

    def _arm(self, rule: _Rule) -> None:
        with self._lock:
            self._rules.append(rule)

    def fail_next(self, n=1, status=500, *, method=None, endpoint=None, path=None, retry_after=None):
        """The next n matching requests answer `status` (429: with Retry-After if given)."""
        self._arm(_Rule("fail", n, method, endpoint, path, {"status": status, "retry_after": retry_after}))

    def fail_for(self, seconds, status=429, *, method=None, endpoint=None, path=None, retry_after=None):
        """Every matching request answers `status` for the next `seconds` (a rate limit's spell: every runtime's
        commits refused alike, as the Hub's limit of commits per repo refuses them)."""
        self._arm(_Rule("fail", 1 << 62, method, endpoint, path, {"status": status, "retry_after": retry_after},
                        until=time.monotonic() + seconds))

    def stall(self, seconds, n=1, *, method=None, endpoint=None, path=None, body_fraction=0.5):
        """The next n matching requests hang `seconds`. Downloads (GET resolve) first send the
        headers and `body_fraction` of the body, then hang mid-body; others hang before answering."""
        self._arm(_Rule("stall", n, method, endpoint, path, {"seconds": seconds, "body_fraction": body_fraction}))

    def commit_completes_after_client_gives_up(self, seconds=5.0, n=1, *, drop=False):
        """The next n commits are applied, then the answer is held `seconds` (or, with drop=True,
        the connection is closed without any answer): the commit exists though the client failed."""
        self._arm(_Rule("lost_commit", n, "POST", "commit", None, {"seconds": seconds, "drop": drop}))

    def hide_in_listing(self, path_regex, n=1):
        """The next n tree-listing requests omit files whose path matches `path_regex`."""
        self._arm(_Rule("hide", n, "GET", "tree", None, {"regex": path_regex}))

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()

    def take(self, kind: str, method: str, endpoint: str, path: str) -> dict | None:
        """Consume one use of the first matching rule of `kind`; return its params (or None)."""
        with self._lock:
            for rule in self._rules:
                if rule.kind == kind and rule.matches(method, endpoint, path):
                    rule.remaining -= 1
                    if rule.remaining <= 0:
                        self._rules.remove(rule)
                    return rule.params
        return None


class HubState:
    def __init__(self, lfs_threshold: int = DEFAULT_LFS_THRESHOLD):
        self.lfs_threshold = lfs_threshold
        self.lock = threading.RLock()
        self.repos: dict[tuple[str, str], Repo] = {}
        self.lfs_objects: dict[str, bytes] = {}
        self.faults = Faults()
        self.requests: list[dict] = []  # {"method", "path", "endpoint", "status", "range"}
        self.counts: Counter = Counter()  # (endpoint, method) -> number of requests
        self._ids = itertools.count()

    # -- repos and revisions -------------------------------------------------------------
    def create_repo(self, repo_type: str, repo_id: str, private: bool = False) -> bool:
        """Create the repo with its initial commit; False if it already existed."""
        with self.lock:
            if (repo_type, repo_id) in self.repos:
                return False
            repo = Repo(repo_type, repo_id, private)
            files = {".gitattributes": FileEntry(DEFAULT_GITATTRIBUTES)}
            repo.history.append(self._new_commit(repo, "initial commit", "", files))
            self.repos[(repo_type, repo_id)] = repo
            return True

    def get_repo(self, repo_type: str, repo_id: str) -> Repo:
        repo = self.repos.get((repo_type, repo_id))
        if repo is None:
            raise HubError(404, f"Repository {repo_id} not found", "RepoNotFound")
        return repo

    def resolve(self, repo: Repo, rev: str) -> Commit:
        """Branch name or (prefix of a) commit id -> commit; 404 RevisionNotFound otherwise."""
        if rev == BRANCH:
            return repo.head
        if re.fullmatch(r"[0-9a-f]{7,40}", rev):
            for commit in reversed(repo.history):
                if commit.id.startswith(rev):
                    return commit
        raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")

    def _new_commit(self, repo: Repo, title: str, message: str, files: dict) -> Commit:
        parent = repo.history[-1].id if repo.history else ""
        seed = f"{repo.repo_type}/{repo.repo_id}\n{parent}\n{title}\n{time.time_ns()}\n{next(self._ids)}"
        cid = hashlib.sha1(seed.encode()).hexdigest()
        return Commit(cid, title, message, datetime.now(timezone.utc), dict(files))

    # -- uploads and commits -------------------------------------------------------------
    def upload_mode(self, repo: Repo, path: str, size: int) -> str:
        if size == 0:
            return "regular"
        if size > self.lfs_threshold:
            return "lfs"
        attrs = repo.head.files.get(".gitattributes")
        patterns = _lfs_patterns(attrs.content) if attrs else []
        name = path.rsplit("/", 1)[-1]
        return "lfs" if any(fnmatch.fnmatch(path, p) or fnmatch.fnmatch(name, p) for p in patterns) else "regular"

    def store_lfs_object(self, oid: str, data: bytes) -> None:
        actual = hashlib.sha256(data).hexdigest()
        if actual != oid:
            raise HubError(400, f"sha256 mismatch: URL says {oid}, body hashes to {actual}")
        with self.lock:
            self.lfs_objects[oid] = data

    def commit(self, repo: Repo, branch: str, header: dict, ops: list[tuple[str, dict]]) -> Commit:
        """Apply NDJSON operations atomically on top of `branch`, compare-and-swap on parentCommit."""
        if branch != BRANCH:
            raise HubError(404, f"Branch {branch} not found (only '{BRANCH}' is emulated)", "RevisionNotFound")
        with self.lock:
            parent = header.get("parentCommit")
            if parent and not repo.head.id.startswith(parent):
                # The Hub answers 412 when the branch moved since `parentCommit` (compare-and-swap).
                raise HubError(412, "A commit has happened since. Please refresh and try again.")
            files = dict(repo.head.files)
            for key, value in ops:
                self._apply(files, key, value)
            commit = self._new_commit(repo, header.get("summary", ""), header.get("description", ""), files)
            repo.history.append(commit)
            return commit

    def _apply(self, files: dict, key: str, value: dict) -> None:
        path = value.get("path", "").strip("/")
        if key == "file":
            files[path] = FileEntry(base64.b64decode(value["content"]))
        elif key == "lfsFile":
            data = self.lfs_objects.get(value["oid"])
            if data is None:
                raise HubError(422, f"LFS object {value['oid']} for {path} was never uploaded")
            files[path] = FileEntry(data, value["oid"])
        elif key == "deletedFile":
            if files.pop(path, None) is None:
                raise HubError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
        elif key == "deletedFolder":
            doomed = [p for p in files if p.startswith(path + "/")] if path else list(files)
            if not doomed:
                raise HubError(404, f"A folder with this name doesn't exist: {path}", "EntryNotFound")
            for p in doomed:
                del files[p]
        else:
            raise HubError(400, f"Unsupported commit operation: {key}")

    def super_squash(self, repo: Repo, branch: str, message: str) -> Commit:
        if branch != BRANCH:
            raise HubError(404, f"Branch {branch} not found", "RevisionNotFound")
        with self.lock:
            commit = self._new_commit(repo, message, "", repo.head.files)
            repo.history[:] = [commit]
            return commit

    # -- request log -----------------------------------------------------------------------
    def record(self, method: str, path: str, endpoint: str, range_header: str | None) -> dict:
        entry = {"method": method, "path": path, "endpoint": endpoint, "status": None, "range": range_header}
        with self.lock:
            self.requests.append(entry)
            self.counts[(endpoint, method)] += 1
        return entry

    # -- read-back helpers for test assertions ---------------------------------------------
    def head(self, repo_id: str, repo_type: str = "model") -> str:
        with self.lock:
            return self.get_repo(repo_type, repo_id).head.id

    def files(self, repo_id: str, revision: str = BRANCH, repo_type: str = "model") -> dict[str, bytes]:
        with self.lock:
            repo = self.get_repo(repo_type, repo_id)
            return {p: f.content for p, f in self.resolve(repo, revision).files.items()}

    def commit_log(self, repo_id: str, repo_type: str = "model") -> list[Commit]:
        """Commits of `main`, newest first (same order as list_repo_commits)."""
        with self.lock:
            return list(reversed(self.get_repo(repo_type, repo_id).history))

    def count(self, endpoint: str, method: str | None = None) -> int:
        with self.lock:
            return sum(n for (ep, m), n in self.counts.items() if ep == endpoint and method in (None, m))


def _lfs_patterns(gitattributes: bytes) -> list[str]:
    lines = (line.split() for line in gitattributes.decode(errors="replace").splitlines())
    return [parts[0] for parts in lines if len(parts) > 1 and "filter=lfs" in parts[1:]]


# -- tree helpers (pure functions over a snapshot) -----------------------------------------
def directories(files: dict) -> set[str]:
    """Every folder implied by the file paths (git has no empty folders)."""
    return {"/".join(p.split("/")[:i]) for p in files for i in range(1, p.count("/") + 1)}


def tree_oid(files: dict, folder: str) -> str:
    """A stable stand-in for git's tree id: changes iff something below `folder` changed."""
    below = sorted((p, f.oid) for p, f in files.items() if p.startswith(folder + "/"))
    return hashlib.sha1(repr(below).encode()).hexdigest()


def list_tree(files: dict, folder: str, recursive: bool) -> list[tuple[str, str]]:
    """(kind, path) entries below `folder` ("" = root), folders first then files, sorted."""
    folder = folder.strip("/")
    dirs = directories(files)
    if folder and folder not in dirs:
        raise HubError(404, f"{folder} does not exist on the branch", "EntryNotFound")
    prefix = folder + "/" if folder else ""

    def wanted(path: str) -> bool:
        return path.startswith(prefix) and (recursive or "/" not in path[len(prefix):])

    return [("directory", d) for d in sorted(dirs) if wanted(d)] + [("file", p) for p in sorted(files) if wanted(p)]


def last_commit_touching(repo: Repo, commit: Commit, path: str) -> Commit:
    """The newest commit, up to `commit`, that changed `path` (a file or a folder)."""

    def signature(c: Commit):
        entry = c.files.get(path)
        return entry.oid if entry else tree_oid(c.files, path)

    upto = repo.history[: repo.history.index(commit) + 1]
    current = signature(commit)
    for older, newer in zip(reversed(upto[:-1]), reversed(upto)):
        if signature(older) != current:
            return newer
    return upto[0]
