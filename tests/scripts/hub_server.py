"""An emulated Hugging Face Hub HTTP server for tests, with fault injection.

Emulates, for the real `huggingface_hub` client (HfApi(endpoint=...), hf_hub_download(endpoint=...)):
- POST /api/repos/create (409 + {"url"} when it exists, so exist_ok=True works)
- GET  /api/{models|datasets|spaces}/{repo}[/revision/{rev}]          repo_info / model_info
- POST /api/{type}s/{repo}/preupload/{rev}                              lfs vs regular (see hub_state)
- POST /{[datasets/]repo}.git/info/lfs/objects/batch                    LFS batch, "basic" transfer only
- PUT  /_lfs/{sha256}, POST /_lfs/{sha256}/verify                       upload + verify hrefs
- POST /api/{type}s/{repo}/commit/{rev}                                 NDJSON commit, parentCommit CAS (412)
- GET  /api/{type}s/{repo}/tree/{rev}[/{path}]                          list_repo_tree (Link-header pages)
- POST /api/{type}s/{repo}/paths-info/{rev}                             get_paths_info
- GET  /api/{type}s/{repo}/commits/{rev}                                list_repo_commits (newest first)
- GET  /api/{type}s/{repo}/refs, POST /api/{type}s/{repo}/super-squash/{branch}, POST /api/validate-yaml
- HEAD/GET /{[datasets/]repo}/resolve/{rev}/{path}                      hf_hub_download (Range supported)
Errors carry the X-Error-Code values the client maps to exceptions (RepoNotFound, RevisionNotFound,
EntryNotFound). With require_token=True, requests without `Authorization: Bearer hf_...` get 401.

Not emulated: Xet (no X-Xet-* headers are ever sent, xet token routes answer 501 — the client must run
with HF_HUB_DISABLE_XET=1 because it picks Xet for uploads on its own when hf_xet is installed),
multipart LFS, branches other than `main`, tags, pull requests, CommitOperationCopy, gated/private
access control, rate-limit headers (only plain 429 + Retry-After via faults), persistence.

Usage:
    with HubServer() as hub:                  # or: hub = HubServer(); url = hub.start(); ...; hub.stop()
        api = HfApi(endpoint=hub.url, token="hf_test")
        hub.faults.fail_next(2, 503, endpoint="preupload")
        hub.state.head("user/repo"); hub.state.count("commit", "POST")
"""

from __future__ import annotations

import json
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlencode, urlsplit

from hub_state import (
    BRANCH,
    DEFAULT_LFS_THRESHOLD,
    HubError,
    HubState,
    directories,
    last_commit_touching,
    list_tree,
    tree_oid,
    utc_iso,
)

_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space", None: "model", "": "model"}
_API = r"^/api/(?P<rtype>models|datasets|spaces)/(?P<repo>[^/]+/[^/]+)"
_GIT = r"^/(?:(?P<rtype>datasets|spaces)/)?(?P<repo>[^/]+/[^/]+)"
# (methods, regex on the raw path, endpoint name). Raw = still %-encoded, so "%2F" stays in its segment.
ROUTES = [
    ("POST", r"^/api/repos/create$", "create_repo"),
    ("GET", r"^/api/whoami-v2$", "whoami"),
    ("POST", r"^/api/validate-yaml$", "validate_yaml"),
    ("GET", _API + r"(?:/revision/(?P<rev>[^/]+))?$", "repo_info"),
    ("POST", _API + r"/preupload/(?P<rev>[^/]+)$", "preupload"),
    ("POST", _API + r"/commit/(?P<rev>[^/]+)$", "commit"),
    ("GET", _API + r"/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?$", "tree"),
    ("POST", _API + r"/paths-info/(?P<rev>[^/]+)$", "paths_info"),
    ("GET", _API + r"/commits/(?P<rev>[^/]+)$", "commits"),
    ("GET", _API + r"/refs$", "refs"),
    ("POST", _API + r"/super-squash/(?P<rev>[^/]+)$", "super_squash"),
    ("GET POST", _API + r"/xet-(?:read|write)-token/.*$", "xet_token"),
    ("POST", _GIT + r"\.git/info/lfs/objects/batch$", "lfs_batch"),
    ("PUT", r"^/_lfs/(?P<oid>[0-9a-f]{64})$", "lfs_upload"),
    ("POST", r"^/_lfs/(?P<oid>[0-9a-f]{64})/verify$", "lfs_verify"),
    ("GET HEAD", _GIT + r"/resolve/(?P<rev>[^/]+)/(?P<path>.+)$", "resolve"),
]
_NO_AUTH = {"lfs_upload"}  # the client PUTs to the upload href without credentials (it is a presigned URL)


class HubServer:
    def __init__(self, *, require_token=False, page_size=1000, lfs_threshold=DEFAULT_LFS_THRESHOLD,
                 host="127.0.0.1", port=0):
        self.state = HubState(lfs_threshold)
        self.faults = self.state.faults
        self.require_token, self.page_size = require_token, page_size
        self._addr = (host, port)
        self._httpd: ThreadingHTTPServer | None = None
        self.stopping = threading.Event()  # wakes stalled handlers on stop()
        self.url = ""

    def start(self) -> str:
        self._httpd = ThreadingHTTPServer(self._addr, _Handler)
        self._httpd.daemon_threads = True
        self._httpd.hub = self
        self.url = "http://%s:%d" % self._httpd.server_address[:2]
        threading.Thread(target=self._httpd.serve_forever, args=(0.05,), name="hub-server", daemon=True).start()
        return self.url

    def stop(self) -> None:
        self.stopping.set()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> "HubServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def repo_url(self, repo_type: str, repo_id: str) -> str:
        prefix = "" if repo_type == "model" else f"{repo_type}s/"
        return f"{self.url}/{prefix}{repo_id}"


class _Drop(Exception):
    """Close the connection without answering."""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like the Hub: the client pools connections

    def log_message(self, *args) -> None:  # keep pytest output clean
        pass

    def setup(self) -> None:
        super().setup()
        # Headers and body leave in separate writes: without NODELAY, Nagle + delayed ACK cost ~40 ms each.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)

    do_GET = do_HEAD = do_POST = do_PUT = lambda self: self._dispatch()

    # -- plumbing --------------------------------------------------------------------------
    @property
    def hub(self) -> HubServer:
        return self.server.hub

    def _dispatch(self) -> None:
        split = urlsplit(self.path)
        self.query, self.stall = parse_qs(split.query), None
        self.body = self._read_body()  # always drain it, or the next keep-alive request is garbage
        endpoint, self.args = "unknown", {}
        for methods, pattern, name in ROUTES:
            m = re.match(pattern, split.path)
            if m and self.command in methods.split():
                endpoint, self.args = name, {k: unquote(v) for k, v in m.groupdict().items() if v is not None}
                break
        self.log = self.hub.state.record(self.command, split.path, endpoint, self.headers.get("Range"))
        try:
            self._check_auth(endpoint)
            self._inject_faults(endpoint, split.path)
            if endpoint == "unknown":
                raise HubError(404, f"Not emulated: {self.command} {split.path}")
            getattr(self, "h_" + endpoint)()
        except HubError as err:
            self._send_error(err)
        except _Drop:
            self.close_connection = True
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client gave up (timeout) while we were stalling
        except Exception as err:  # a bug here should surface as a 500, not a hung client
            self._send_error(HubError(500, f"emulator error: {err!r}"))

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while (size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)) > 0:
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            while self.rfile.readline().strip():  # trailers
                pass
            return b"".join(chunks)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, ctype="application/json"):
        self.log["status"] = status
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, obj, status=200, headers=None) -> None:
        self._send(status, json.dumps(obj).encode(), headers)

    def _send_error(self, err: HubError) -> None:
        headers = {"X-Error-Message": err.message, **err.headers}
        if err.code:
            headers["X-Error-Code"] = err.code
        self._json({"error": err.message}, err.status, headers)

    def _json_body(self) -> dict:
        try:
            return json.loads(self.body or b"{}")
        except ValueError:
            raise HubError(400, "body is not JSON")

    def _check_auth(self, endpoint: str) -> None:
        auth = self.headers.get("Authorization", "")
        if auth and not auth.startswith("Bearer hf_"):
            raise HubError(401, "Invalid credentials in Authorization header")
        if self.hub.require_token and not auth and endpoint not in _NO_AUTH:
            # Like the Hub for a private repo seen anonymously: 401 + RepoNotFound (-> RepositoryNotFoundError).
            code = "RepoNotFound" if "repo" in (self.args or {}) else None
            raise HubError(401, "Invalid username or password.", code)

    def _inject_faults(self, endpoint: str, path: str) -> None:
        faults = self.hub.faults
        fail = faults.take("fail", self.command, endpoint, path)
        if fail:
            extra = {"Retry-After": str(fail["retry_after"])} if fail["retry_after"] is not None else {}
            raise HubError(fail["status"], f"injected fault: HTTP {fail['status']}", headers=extra)
        self.stall = faults.take("stall", self.command, endpoint, path)
        if self.stall and not (endpoint == "resolve" and self.command == "GET"):
            self.hub.stopping.wait(self.stall["seconds"])  # downloads stall mid-body instead

    def _repo(self):
        repo_type = _TYPES[self.args.get("rtype")]
        return self.hub.state.get_repo(repo_type, self.args["repo"])

    def _commit_at_rev(self):
        repo = self._repo()
        return repo, self.hub.state.resolve(repo, self.args.get("rev", BRANCH))

    # -- repos -------------------------------------------------------------------------------
    def h_create_repo(self) -> None:
        body = self._json_body()
        repo_type = body.get("type") or "model"
        repo_id = f"{body.get('organization') or 'user'}/{body['name']}"
        private = body.get("visibility") == "private" or bool(body.get("private"))
        url = self.hub.repo_url(repo_type, repo_id)
        if not self.hub.state.create_repo(repo_type, repo_id, private):
            return self._json({"error": f"You already created this {repo_type} repo", "url": url}, 409)
        self._json({"url": url, "name": repo_id, "id": repo_id})

    def h_repo_info(self) -> None:
        repo, commit = self._commit_at_rev()
        blobs = self.query.get("blobs", ["false"])[0].lower() == "true"
        siblings = []
        for path, f in sorted(commit.files.items()):
            sib = {"rfilename": path}
            if blobs:
                sib.update(size=f.size, blobId=f.oid)
                if f.sha256:
                    sib["lfs"] = {"size": f.size, "sha256": f.sha256, "pointerSize": len(f.pointer)}
            siblings.append(sib)
        self._json({
            "id": repo.repo_id, "author": repo.repo_id.split("/")[0], "sha": commit.id,
            "private": repo.private, "disabled": False, "gated": False, "tags": [],
            "downloads": 0, "likes": 0, "lastModified": utc_iso(repo.head.date),
            "createdAt": utc_iso(repo.history[0].date), "siblings": siblings,
        })

    def h_whoami(self) -> None:  # every token is the user "user", who owns the repos it creates
        self._json({"type": "user", "name": "user", "fullname": "Emulated User", "orgs": [],
                    "auth": {"type": "access_token", "accessToken": {"role": "write"}}})

    def h_validate_yaml(self) -> None:
        self._json({"errors": [], "warnings": []})

    def h_xet_token(self) -> None:
        raise HubError(501, "Xet is not emulated: run the client with HF_HUB_DISABLE_XET=1")

    def h_refs(self) -> None:
        head = self._repo().head.id
        branch = {"name": BRANCH, "ref": f"refs/heads/{BRANCH}", "targetCommit": head}
        self._json({"branches": [branch], "converts": [], "tags": [], "pullRequests": []})

    # -- uploads -----------------------------------------------------------------------------
    def h_preupload(self) -> None:
        repo, commit = self._commit_at_rev()
        answer = []
        for item in self._json_body().get("files", []):
            mode = self.hub.state.upload_mode(repo, item["path"], int(item["size"]))
            entry = {"path": item["path"], "uploadMode": mode, "shouldIgnore": False}
            existing = commit.files.get(item["path"])
            if existing is not None:
                # The client skips unchanged files by comparing this oid: sha256 for LFS, git sha1 otherwise.
                entry["oid"] = existing.sha256 if mode == "lfs" and existing.sha256 else existing.oid
            answer.append(entry)
        self._json({"files": answer, "commitOid": commit.id})

    def h_lfs_batch(self) -> None:
        self._repo()
        body = self._json_body()
        if body.get("operation") != "upload" or "basic" not in body.get("transfers", ["basic"]):
            raise HubError(400, "only 'upload' with the 'basic' transfer is emulated")
        objects = []
        for obj in body.get("objects", []):
            entry = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
            if obj["oid"] not in self.hub.state.lfs_objects:  # no "actions" = already stored, client skips
                entry["actions"] = {
                    "upload": {"href": f"{self.hub.url}/_lfs/{obj['oid']}", "header": {}},
                    "verify": {"href": f"{self.hub.url}/_lfs/{obj['oid']}/verify", "header": {}},
                }
            objects.append(entry)
        # "basic" on purpose: never "xet" (or "multipart"), so the client uploads with a plain PUT.
        self._send(200, json.dumps({"transfer": "basic", "objects": objects}).encode(),
                   ctype="application/vnd.git-lfs+json")

    def h_lfs_upload(self) -> None:
        self.hub.state.store_lfs_object(self.args["oid"], self.body)
        self._send(200, b"", {"ETag": f'"{self.args["oid"]}"'})

    def h_lfs_verify(self) -> None:
        stored = self.hub.state.lfs_objects.get(self.args["oid"])
        if stored is None or len(stored) != self._json_body().get("size", len(stored)):
            raise HubError(404, f"LFS object {self.args['oid']} not found or wrong size")
        self._json({"success": True})

    def h_commit(self) -> None:
        if self.query.get("create_pr", ["0"])[0] not in ("0", "false"):
            raise HubError(400, "pull requests are not emulated")
        lines = [json.loads(line) for line in self.body.splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "NDJSON commit payload must start with a header line")
        repo = self._repo()
        ops = [(line["key"], line["value"]) for line in lines[1:]]
        commit = self.hub.state.commit(repo, self.args["rev"], lines[0]["value"], ops)
        lost = self.hub.faults.take("lost_commit", "POST", "commit", self.log["path"])
        if lost:
            if lost["drop"]:
                raise _Drop()  # committed, but the client never hears about it
            self.hub.stopping.wait(lost["seconds"])
        url = f"{self.hub.repo_url(repo.repo_type, repo.repo_id)}/commit/{commit.id}"
        self._json({"success": True, "commitOid": commit.id, "commitUrl": url, "pullRequestUrl": None,
                    "hookOutput": ""})

    def h_super_squash(self) -> None:
        repo = self._repo()
        commit = self.hub.state.super_squash(repo, self.args["rev"], self._json_body().get("message", "squash"))
        self._json({"commitId": commit.id})

    # -- listings ----------------------------------------------------------------------------
    def _entry_json(self, repo, commit, kind: str, path: str, expand: bool) -> dict:
        if kind == "directory":
            entry = {"type": "directory", "oid": tree_oid(commit.files, path), "size": 0, "path": path}
        else:
            f = commit.files[path]
            entry = {"type": "file", "oid": f.oid, "size": f.size, "path": path}
            if f.sha256:
                entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": len(f.pointer)}
        if expand:
            last = last_commit_touching(repo, commit, path)
            entry["lastCommit"] = {"id": last.id, "title": last.title, "date": utc_iso(last.date)}
        return entry

    def _page(self, items: list, make_json) -> None:
        """Cursor pagination with a GitHub-style Link header, as the client's `paginate` expects."""
        start = int(self.query.get("cursor", ["0"])[0])
        end = start + self.hub.page_size
        headers = {}
        if end < len(items):
            params = {k: v[0] for k, v in self.query.items()} | {"cursor": str(end)}
            headers["Link"] = f'<{self.hub.url}{urlsplit(self.path).path}?{urlencode(params)}>; rel="next"'
        self._json([make_json(item) for item in items[start:end]], headers=headers)

    def h_tree(self) -> None:
        repo, commit = self._commit_at_rev()
        flag = lambda name: self.query.get(name, ["false"])[0].lower() in ("true", "1")
        entries = list_tree(commit.files, self.args.get("path", ""), flag("recursive"))
        hide = self.hub.faults.take("hide", "GET", "tree", self.log["path"])
        if hide:  # an eventually-consistent listing: matching files are missing from it
            entries = [(k, p) for k, p in entries if k != "file" or not re.search(hide["regex"], p)]
        self._page(entries, lambda e: self._entry_json(repo, commit, e[0], e[1], flag("expand")))

    def h_paths_info(self) -> None:
        repo, commit = self._commit_at_rev()
        form = parse_qs(self.body.decode())  # the client posts form data: paths=a&paths=b&expand=False
        expand = form.get("expand", ["false"])[0].lower() == "true"
        folders = directories(commit.files)
        found = []
        for path in (p.strip("/") for p in form.get("paths", [])):
            if path in commit.files:
                found.append(self._entry_json(repo, commit, "file", path, expand))
            elif path in folders:
                found.append(self._entry_json(repo, commit, "directory", path, expand))
        self._json(found)

    def h_commits(self) -> None:
        repo, commit = self._commit_at_rev()
        history = list(reversed(repo.history[: repo.history.index(commit) + 1]))
        self._page(history, lambda c: {"id": c.id, "title": c.title, "message": c.message,
                                       "authors": [{"user": "user"}], "date": utc_iso(c.date)})

    # -- downloads ---------------------------------------------------------------------------
    def h_resolve(self) -> None:
        repo = self._repo()
        commit = self.hub.state.resolve(repo, self.args["rev"])
        f = commit.files.get(self.args["path"])
        if f is None:  # X-Repo-Commit lets the client cache the non-existence
            raise HubError(404, "Entry not found", "EntryNotFound", {"X-Repo-Commit": commit.id})
        headers = {"X-Repo-Commit": commit.id, "ETag": f'"{f.oid}"', "Accept-Ranges": "bytes"}
        if f.sha256:  # the client prefers X-Linked-Etag (sha256) to name the cached blob
            headers.update({"X-Linked-Etag": f'"{f.sha256}"', "X-Linked-Size": str(f.size)})
        body, status = f.content, 200
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if match:  # resume after a broken download
            start, end = int(match[1]), int(match[2] or f.size - 1)
            if start >= f.size:
                raise HubError(416, "Range Not Satisfiable", headers={"Content-Range": f"bytes */{f.size}"})
            body, status = f.content[start:end + 1], 206
            headers["Content-Range"] = f"bytes {start}-{start + len(body) - 1}/{f.size}"
        if self.command == "GET" and self.stall:
            return self._send_stalled(status, body, headers)
        self._send(status, body, headers, ctype="application/octet-stream")

    def _send_stalled(self, status: int, body: bytes, headers: dict) -> None:
        """Headers and the first part of the body, then hang (mid-body stall), then the rest."""
        cut = int(len(body) * self.stall["body_fraction"])
        self.log["status"] = status
        self.send_response(status)
        for key, value in {"Content-Type": "application/octet-stream", "Content-Length": str(len(body)),
                           **headers}.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body[:cut])
        self.wfile.flush()
        self.hub.stopping.wait(self.stall["seconds"])
        self.wfile.write(body[cut:])  # raises BrokenPipe if the client timed out meanwhile
