"""Google Drive's API v3: what Drive's servers hold of a checkpoint folder (md5 and size of each file).

DriveFS's attributes say what the VM's Drive daemon believes it uploaded; the API answers from
Google's side. `DriveApi` finds a folder's id once (from `user.drive.id` where the mount reports
one, else by walking from Drive's root by name, skipping trashed items and refusing two folders of
one name), caches it, and lists a checkpoint folder's children in one paged `files.list` call.
`confirm` says a folder is in the cloud only when every expected file is there once, not trashed,
with the expected size and md5.

A failed call is never an answer: a rate limit (429, or 403 with the reasons google-api-python-client
itself retries) and 5xx raise `ApiUnavailable` (an OSError: "unknown, look again later"); any other 403
(no permission, the API not enabled, a domain's policy) raises `ApiRefused`, an ApiUnavailable too, so that
it never decides anything either, but one that says asking again will not help; 404 raises
FileNotFoundError ("not there yet"). Nothing here retries or sleeps: the caller polls on its own
schedule, and `calls` counts every request sent.

The endpoint can be Google's (Colab: `google.colab.auth.authenticate_user()` grants it) or any
emulator or account: `DriveApi(endpoint="http://127.0.0.1:PORT", root=FOLDER)` with anonymous
credentials, also from `COLAB_KIT_DRIVE_API` and `COLAB_KIT_DRIVE_ROOT`.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from urllib.parse import urlparse

from ..errors import DriveError
from .drivefs import cloud_id

__all__ = ["FOLDER", "AmbiguousFolder", "ApiRefused", "ApiUnavailable", "DriveApi", "quote", "unavailable_message"]

FOLDER = "application/vnd.google-apps.folder"
ENV_ENDPOINT, ENV_ROOT = "COLAB_KIT_DRIVE_API", "COLAB_KIT_DRIVE_ROOT"
COLAB_ROOT = "/content/drive/MyDrive"
_LIST_FIELDS = "nextPageToken, files(id, name, md5Checksum, size, modifiedTime, trashed)"
# The 403 reasons that are rate limits: the ones google-api-python-client's own retry takes
# (googleapiclient.http._should_retry_response); every other 403 is a refusal.
RATE_LIMIT_REASONS = frozenset({"rateLimitExceeded", "userRateLimitExceeded"})


class ApiUnavailable(OSError):
    """The API did not answer this time (rate limit, server error, no network): nothing is known."""


class ApiRefused(ApiUnavailable):
    """The API refused (a 403 that is no rate limit: a permission, the API not enabled): nothing is known of
    the files, as for any failed call, and asking again will not help until access is granted."""


class AmbiguousFolder(DriveError):
    """Two folders of one name where the kit looks for one: it will not guess which is the run's."""


def quote(name: str) -> str:
    """`name` as a string literal of Drive's query language."""
    return "'" + name.replace("\\", "\\\\").replace("'", "\\'") + "'"


class DriveApi:
    """Drive API v3 for one Drive: folder ids, listings, deletes, and a count of the calls made.

    Args:
        endpoint: an emulated or proxied API ("http://127.0.0.1:PORT"), used with anonymous
            credentials; None for Google's, with `credentials` or the environment's default ones.
        root: the local folder that shows Drive's root (`/content/drive/MyDrive` in Colab).
        credentials: google-auth credentials for Google's endpoint (None: `google.auth.default()`).
    """

    def __init__(self, endpoint: str | None = None, root: str | os.PathLike | None = None, *, credentials=None):
        if endpoint is not None and urlparse(endpoint).scheme not in ("http", "https"):
            raise ValueError(f"endpoint={endpoint!r}: give the API's address, such as http://127.0.0.1:8080")
        self.endpoint = endpoint
        self.root = Path(root if root is not None else COLAB_ROOT)
        self.credentials = credentials
        self.calls = 0
        self._service = None
        self._ids: dict[Path, str] = {}
        self._lock = threading.Lock()
        self._requests = threading.Lock()

    @classmethod
    def from_environment(cls, environ=None) -> DriveApi | None:
        """The API named by COLAB_KIT_DRIVE_API (and COLAB_KIT_DRIVE_ROOT), or None when unset."""
        environ = os.environ if environ is None else environ
        endpoint = environ.get(ENV_ENDPOINT)
        if not endpoint:
            return None
        return cls(endpoint, environ.get(ENV_ROOT) or None)

    def describe(self) -> str:
        return f"the Drive API at {self.endpoint}" if self.endpoint else "Google's Drive API"

    # -- requests --------------------------------------------------------------------------------
    def service(self):
        """The googleapiclient resource (built once; the discovery document ships with the package).

        Raises:
            ImportError: google-api-python-client is not installed (Colab has it).
        """
        if self._service is None:
            from googleapiclient.discovery import build

            options, credentials = None, self.credentials
            if self.endpoint is not None:
                from google.auth.credentials import AnonymousCredentials

                base = self.endpoint if urlparse(self.endpoint).path not in ("", "/") else \
                    self.endpoint.rstrip("/") + "/drive/v3/"
                options, credentials = {"api_endpoint": base}, credentials or AnonymousCredentials()
            elif credentials is None:
                import google.auth

                credentials, _ = google.auth.default(scopes=["https://www.googleapis.com/auth/drive"])
            self._service = build("drive", "v3", credentials=credentials, client_options=options,
                                  cache_discovery=False, static_discovery=True)
        return self._service

    def _execute(self, request):
        from googleapiclient.errors import HttpError

        with self._lock:
            self.calls += 1
        try:
            with self._requests:  # httplib2 is not thread-safe: the mirror's thread and run.finish both poll
                return request.execute(num_retries=0)
        except HttpError as exc:
            status = int(getattr(exc.resp, "status", 0) or 0)
            if status == 404:
                raise FileNotFoundError(f"not in Drive: {exc}") from None
            if status == 403 and not _reasons(exc) & RATE_LIMIT_REASONS:
                raise ApiRefused(f"Drive API refused (403: {_reason(exc)}): a permission, not a rate limit, so asking "
                                 f"again will not help until this account may read the folder") from None
            raise ApiUnavailable(f"Drive API answered {status}: {_reason(exc)}") from None
        except Exception as exc:  # noqa: BLE001 - no network (httplib2's own errors too), expired credentials,
            # an unreadable answer: nothing is known, and the caller (the mirror's thread) must go on
            raise ApiUnavailable(f"Drive API unreachable: {type(exc).__name__}: {exc}") from None

    def list_children(self, parent: str, *, query: str = "", fields: str = _LIST_FIELDS) -> list[dict]:
        """Every item under folder id `parent` that is not trashed (and matches `query`), all pages."""
        q = f"{quote(parent)} in parents and trashed = false" + (f" and {query}" if query else "")
        files, token = [], None
        while True:
            answer = self._execute(self.service().files().list(q=q, fields=fields, pageSize=1000, pageToken=token,
                                                                spaces="drive"))
            files += answer.get("files", [])
            token = answer.get("nextPageToken")
            if not token:
                return files

    # -- folders ---------------------------------------------------------------------------------
    def folder_id(self, folder: str | os.PathLike, *, fresh: bool = False) -> str:
        """The id of a local folder of the mount: cached; from `user.drive.id` where it answers with
        a cloud id, else found by name from the root. `fresh`: nothing remembered is used (no cached id of
        it or of a folder above it): the id belongs to the folder at this path now, found through this
        parent chain, which is what a delete may act on.

        Raises:
            FileNotFoundError: not in Drive (yet). AmbiguousFolder: two folders of one name on the way.
            ApiUnavailable: the API did not answer.
        """
        folder = Path(folder)
        with self._lock:
            if folder in self._ids and not fresh:
                return self._ids[folder]
        try:
            relative = folder.relative_to(self.root)
        except ValueError:
            raise DriveError(f"{folder} is not under {self.root}, the folder that shows Drive's root: give "
                             f"DriveApi(root=...) (COLAB_KIT_DRIVE_ROOT) the mount's MyDrive") from None
        found = None if fresh else cloud_id(folder)
        if found is None:
            found = "root"
            walked = self.root
            for name in relative.parts:
                walked = walked / name
                with self._lock:
                    cached = None if fresh else self._ids.get(walked)
                if cached is not None:
                    found = cached
                    continue
                matches = self.list_children(found, query=f"name = {quote(name)} and mimeType = {quote(FOLDER)}",
                                             fields="nextPageToken, files(id, name)")
                if not matches:
                    raise FileNotFoundError(f"no folder {walked} in Drive (yet)")
                if len(matches) > 1:
                    raise AmbiguousFolder(
                        f"Drive has {len(matches)} folders named {name!r} in {walked.parent} (ids "
                        f"{', '.join(m['id'] for m in matches)}), so the kit cannot tell which one this runtime "
                        f"writes to. Rename or delete the extra ones at drive.google.com (or empty the Trash "
                        f"if they are there), then run the cell again")
                found = matches[0]["id"]
                with self._lock:
                    self._ids[walked] = found
        with self._lock:
            self._ids[folder] = found
        return found

    def forget(self, folder: str | os.PathLike) -> None:
        """Drop the cached ids of `folder` and everything under it (moved, deleted, or found stale): an id
        belongs to one folder instance, and the next one at the same path has another."""
        folder = Path(folder)
        with self._lock:
            for path in [p for p in self._ids if p == folder or folder in p.parents]:
                del self._ids[path]

    def children(self, folder: str | os.PathLike, *, fresh: bool = False) -> dict[str, list[dict]]:
        """name -> the items of that name in `folder` (not trashed), from one listing (`fresh`: the
        folder's id found afresh, see `folder_id`)."""
        try:
            items = self.list_children(self.folder_id(folder, fresh=fresh))
        except FileNotFoundError:  # a cached id that no longer exists: found again next time
            self.forget(folder)
            raise
        named: dict[str, list[dict]] = {}
        for item in items:
            named.setdefault(item["name"], []).append(item)
        return named

    def confirm(self, folder: str | os.PathLike, expected: dict[str, tuple[int, str | None]]) -> tuple[bool, int]:
        """Is every file of `folder` in the cloud as expected? `expected`: name -> (size, md5).

        Returns (all there, bytes not there yet). A file counts once exactly one item of its name is
        there with that size and md5 (a file rewritten after upload, or two of one name, does not).
        """
        named = self.children(folder)
        missing = 0
        for name, (size, md5) in expected.items():
            items = named.get(name, [])
            good = len(items) == 1 and int(items[0].get("size", -1)) == size and (
                md5 is None or items[0].get("md5Checksum") == md5)
            if not good:
                missing += size
        return missing == 0, missing

    def delete(self, folder: str | os.PathLike, *, manifest_md5: str | None = None, manifest: str = "") -> None:
        """Delete `folder` in Drive for good (`files.delete`: no Trash), with everything in it.

        Its id is found afresh (`folder_id(fresh=True)`), never one remembered from a folder since moved
        away; with `manifest_md5`, Drive must hold exactly one file `manifest` in it with that md5 (the
        folder is the checkpoint that was chosen), or nothing is deleted.

        Raises:
            DriveError: the folder in Drive is not the one chosen (its manifest differs), or it is the root.
            FileNotFoundError: not in Drive. ApiUnavailable: the API did not answer (nothing deleted).
        """
        item = self.folder_id(folder, fresh=True)
        if item == "root":
            raise DriveError("refusing to delete Drive's root")
        if manifest_md5 is not None:
            held = [f.get("md5Checksum") for f in self.list_children(item) if f.get("name") == manifest]
            if held != [manifest_md5]:
                raise DriveError(f"{folder} in Drive holds another {manifest} (md5 {held or 'none'}, expected "
                                 f"{manifest_md5}): not the checkpoint chosen, so it was not deleted")
        self._execute(self.service().files().delete(fileId=item))
        self.forget(folder)


def _reasons(exc) -> set[str]:
    """The reasons of an HttpError's answer, from the client's own parse (`error_details`)."""
    details = getattr(exc, "error_details", None)
    if not isinstance(details, list):
        return set()
    return {d.get("reason") for d in details if isinstance(d, dict) and d.get("reason")}


def _reason(exc) -> str:
    try:
        import json

        error = json.loads(exc.content.decode()).get("error", {})
        reasons = [e.get("reason") for e in error.get("errors", []) if e.get("reason")]
        return f"{error.get('message', '')} ({', '.join(reasons)})" if reasons else error.get("message", str(exc))
    except Exception:  # noqa: BLE001 - the status alone still says enough
        return str(exc)[:200]


def unavailable_message(exc: BaseException) -> str:
    """Why API confirmation cannot be used here, for the one message that says so."""
    if isinstance(exc, ImportError):
        return ("google-api-python-client is not installed (Colab has it; elsewhere: pip install "
                "google-api-python-client google-auth)")
    return f"{type(exc).__name__}: {exc}"
