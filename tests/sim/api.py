"""Drive's API v3 over the simulator's cloud: a stand-in for the `googleapiclient` resource that
`colab_kit.drive.driveapi.DriveApi` builds, so that the kit's own API code (ids, listings, confirm,
delete) runs unchanged. What it answers is the cloud as it is (`model.DriveModel`): an item exists once
its upload is there, with its md5 and size. Faults: a fraction of requests answer 403 or 500, and a
listing of several pages may fail on a later page.
"""

from __future__ import annotations

import json

import httplib2
from googleapiclient.errors import HttpError

from drive_api_server import FOLDER, parse_query

__all__ = ["FakeDriveService"]


def _http_error(status: int, reason: str) -> HttpError:
    body = json.dumps({"error": {"code": status, "message": reason, "errors": [{"reason": reason}]}}).encode()
    return HttpError(httplib2.Response({"status": str(status)}), body)


class _Request:
    def __init__(self, answer, service):
        self._answer, self._service = answer, service

    def execute(self, num_retries: int = 0):
        self._service.requests += 1
        return self._answer()


class FakeDriveService:
    """`service.files().list(...)`, `.delete(...)`; `fail` is the fraction of requests that fail; pages of
    `page` items, each page after the first failing with probability `fail_page`."""

    def __init__(self, drive, rng, *, fail: float = 0.0, page: int = 3, fail_page: float = 0.0, log=None):
        self.drive, self.rng, self.fail, self.page, self.fail_page, self.log = drive, rng, fail, page, fail_page, log
        self.requests = 0
        self.down_until = -1.0  # an outage the world opens: every request answers 503
        self.clock = None

    def files(self):
        return self

    def _faulty(self, what: str) -> None:
        if self.clock is not None and self.clock.monotonic() < self.down_until:
            raise _http_error(503, "backendError")
        if self.fail and self.rng.random() < self.fail:
            status = self.rng.choice((403, 500))
            if self.log:
                self.log(f"fault api {status} {what}")
            raise _http_error(status, "rateLimitExceeded" if status == 403 else "backendError")

    def _path_of(self, item_id: str) -> str | None:
        for path, folder_id in self.drive.dirs.items():
            if folder_id == item_id:
                return path
        return None

    def list(self, q: str, fields: str = "", pageSize: int = 100, pageToken=None, spaces: str = "drive"):
        def answer():
            self._faulty("list")
            self.drive.advance(self.clock.monotonic())
            terms = parse_query(q)
            parent = next(v for f, op, v in terms if f == "parents")
            folder = self._path_of(parent)
            items = []
            if folder is not None:
                prefix = folder + "/"
                for path, item in self.drive.files.items():
                    if path.startswith(prefix) and "/" not in path[len(prefix):]:
                        items.append({"id": item.id, "name": path[len(prefix):], "md5Checksum": item.md5,
                                      "size": str(len(item.data)), "mimeType": "application/octet-stream",
                                      "trashed": False})
                for path, folder_id in self.drive.dirs.items():
                    if path.startswith(prefix) and "/" not in path[len(prefix):]:
                        items.append({"id": folder_id, "name": path[len(prefix):], "mimeType": FOLDER,
                                      "trashed": False})
            for field, op, value in terms:
                if field == "name":
                    items = [i for i in items if (i["name"] == value) == (op == "=")]
                elif field == "mimeType":
                    items = [i for i in items if (i["mimeType"] == value) == (op == "=")]
            items.sort(key=lambda i: i["name"])
            start = int(pageToken or 0)
            if start and self.fail_page and self.rng.random() < self.fail_page:
                if self.log:
                    self.log("fault api page 2")
                raise _http_error(500, "backendError")
            page = items[start:start + self.page]
            more = start + self.page < len(items)
            return {"files": page, **({"nextPageToken": str(start + self.page)} if more else {})}

        return _Request(answer, self)

    def delete(self, fileId: str):
        def answer():
            self._faulty("delete")
            path = self._path_of(fileId)
            if path is None:
                path = next((p for p, f in self.drive.files.items() if f.id == fileId), None)
            if path is None:
                raise _http_error(404, "notFound")
            if self.on_delete is not None:
                self.on_delete(path)
            self.drive.delete_item(path)
            return {}

        return _Request(answer, self)

    on_delete = None
