"""An emulated Google Drive API v3, served over the DriveFS emulator's cloud and Trash folders, for tests.

    python drive_api_server.py --cloud DIR --trash DIR [--port P] [--fail P --seed N] [--log FILE]
    server = DriveApiServer(cloud, trash, fail=0.3).start(); server.url; server.stop()

The real `google-api-python-client` talks to it (`client_options={"api_endpoint": server.url}` and
anonymous credentials), so the kit's own code path runs unchanged. What it serves is what the
emulator's mount has uploaded: an item exists here once its upload reached the cloud folder, with
the md5 and size of the bytes there, as Drive's servers report them. Ids are the emulator's
(`drive_items.cloud_id`), so `user.drive.id` on the mount names the same item.

The subset the kit calls:
- `GET  /drive/v3/files?q=...&fields=...&pageSize=...&pageToken=...` (files.list). `q` is a
  conjunction (` and `) of `'<id>' in parents`, `name = '<name>'`, `trashed = false|true` and
  `mimeType = '<type>'` / `mimeType != '<type>'`, with Drive's quoting (\\' and \\\\ in strings).
  Without `trashed = false`, trashed items are listed too (as Drive does).
- `GET  /drive/v3/files/<id>?fields=...` (files.get); `root` is the root folder's alias.
- `DELETE /drive/v3/files/<id>` (files.delete): permanent, no Trash; a folder with everything in it.
Field masks (`files(id,name)`, `nextPageToken`) are applied. Faults: `fail=P` answers a fraction P
of requests with 403 rateLimitExceeded or 500 (seeded), each logged; `fail_first=N` answers the first N
requests with 403 (rateLimitExceeded); `refuse=REASON` answers every request with 403 and that reason
(insufficientPermissions: an account that may not read the folder). Items the emulator cannot make
(two items with one name in a folder) are added with `add_item`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import threading
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from drive_items import cloud_id, trash_index

FOLDER = "application/vnd.google-apps.folder"
_TERM = re.compile(r"""\s*(?:'(?P<value>(?:[^'\\]|\\.)*)'\s+in\s+parents
                        |(?P<field>name|trashed|mimeType)\s*(?P<op>!=|=)\s*(?P<arg>'(?:[^'\\]|\\.)*'|true|false))\s*$""",
                   re.VERBOSE)


def _unquote(text: str) -> str:
    return re.sub(r"\\(.)", r"\1", text)


def parse_query(q: str) -> list[tuple[str, str, str]]:
    """Drive's query language, the forms the kit uses: [(field, op, value)], all to hold."""
    terms = []
    for part in re.split(r"\s+and\s+(?=(?:[^']|'(?:[^'\\]|\\.)*')*$)", q.strip()):
        match = _TERM.match(part)
        if match is None:
            raise ValueError(f"unsupported query term: {part!r}")
        if match.group("value") is not None:
            terms.append(("parents", "in", _unquote(match.group("value"))))
        else:
            arg = match.group("arg")
            terms.append((match.group("field"), match.group("op"), _unquote(arg[1:-1]) if arg.startswith("'") else arg))
    return terms


def apply_fields(item: dict, mask: str | None) -> dict:
    if not mask:
        return {k: item[k] for k in ("kind", "id", "name", "mimeType") if k in item}
    wanted = {f.strip() for f in mask.split(",")}
    return {k: v for k, v in item.items() if k in wanted}


class DriveApiServer:
    """The HTTP server; `calls` counts requests by method, `log` holds (method, path, status)."""

    def __init__(self, cloud, trash, *, fail: float = 0.0, seed: int = 0, port: int = 0, max_page: int = 1000,
                 fail_first: int = 0, refuse: str | None = None):
        self.cloud, self.trash = os.path.abspath(cloud), os.path.abspath(trash)
        self.max_page = max_page  # Drive answers at most 1000 items a page
        self.fail, self.rng = fail, random.Random(seed)
        self.fail_first = fail_first  # the first requests all answer 403 (a rate limit at the start)
        self.refuse = refuse  # every request answers 403 with this reason (a permission refused)
        self.extra: list[dict] = []  # items added by tests (duplicates)
        self.calls: dict[str, int] = {}
        self.log: list[tuple[str, str, int]] = []
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def start(self) -> DriveApiServer:
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="drive-api", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def add_item(self, parent: str, name: str, *, data: bytes = b"", trashed: bool = False,
                 folder: bool = False) -> str:
        """An item the emulator's folders cannot hold (a second item with the same name); returns its id."""
        item_id = f"extra-{len(self.extra) + 1}"
        self.extra.append(_item(item_id, name, parent, FOLDER if folder else None, data, trashed))
        return item_id

    # -- the items -----------------------------------------------------------------------------
    def items(self) -> list[dict]:
        """Every item: the cloud folder's, the trashed ones (from the emulator's index), the added ones."""
        found = []
        for root, dirs, files in os.walk(self.cloud):
            parent = cloud_id(self.cloud, root)
            for name in dirs:
                found.append(_item(cloud_id(self.cloud, os.path.join(root, name)), name, parent, FOLDER))
            for name in files:
                path = os.path.join(root, name)
                try:
                    found.append(_item(cloud_id(self.cloud, path), name, parent, None, path=path))
                except FileNotFoundError:  # replaced by an upload meanwhile: listed at the next call
                    continue
        try:
            with open(trash_index(self.trash)) as index:
                for line in index:
                    entry = json.loads(line)
                    path = os.path.join(self.trash, entry["file"])
                    if os.path.exists(path):
                        found.append(_item(entry["id"], entry["name"], entry["parent"], None, path=path, trashed=True))
        except FileNotFoundError:
            pass
        return found + list(self.extra)

    def _by_id(self, item_id: str) -> dict | None:
        item_id = "cloud-root" if item_id == "root" else item_id
        if item_id == "cloud-root":
            return _item("cloud-root", "My Drive", None, FOLDER)
        return next((i for i in self.items() if i["id"] == item_id), None)

    def _path_of(self, item_id: str) -> str | None:
        for root, dirs, files in os.walk(self.cloud):
            for name in dirs + files:
                path = os.path.join(root, name)
                try:
                    if cloud_id(self.cloud, path) == item_id:
                        return path
                except FileNotFoundError:
                    continue
        return None

    # -- requests ------------------------------------------------------------------------------
    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet: the test log has `server.log`
                pass

            def _answer(self, status: int, body: dict | None) -> None:
                data = json.dumps(body).encode() if body is not None else b""
                with server.lock:  # before the answer: a client that has it finds it logged
                    server.log.append((self.command, urlparse(self.path).path, status))
                self.send_response(status)
                if body is not None:
                    self.send_header("Content-Type", "application/json; charset=UTF-8")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _fault(self) -> bool:
                with server.lock:
                    server.calls[self.command] = server.calls.get(self.command, 0) + 1
                    fails = server.fail and server.rng.random() < server.fail
                    status = server.rng.choice([403, 500]) if fails else 0
                    if server.fail_first > 0:
                        server.fail_first -= 1
                        fails, status = True, 403
                    if server.refuse:
                        fails, status = True, 403
                if not fails:
                    return False
                reason = (server.refuse or "rateLimitExceeded") if status == 403 else "backendError"
                self._answer(status, {"error": {"code": status, "message": f"injected {reason}",
                                                "errors": [{"reason": reason, "message": "injected"}]}})
                return True

            def do_GET(self):
                if self._fault():
                    return
                url = urlparse(self.path)
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                if url.path.rstrip("/") == "/drive/v3/files":
                    return self._list(query)
                match = re.fullmatch(r"/drive/v3/files/([^/]+)", url.path)
                if match is None:
                    return self._answer(404, {"error": {"code": 404, "message": f"no route {url.path}"}})
                item = server._by_id(match.group(1))
                if item is None:
                    return self._answer(404, {"error": {"code": 404, "message": f"File not found: {match.group(1)}."}})
                self._answer(200, apply_fields(item, query.get("fields")))

            def _list(self, query: dict) -> None:
                try:
                    terms = parse_query(query.get("q", ""))
                except ValueError as exc:
                    return self._answer(400, {"error": {"code": 400, "message": str(exc)}})
                items = [i for i in server.items() if all(_holds(i, t) for t in terms)]
                items.sort(key=lambda i: (i["name"], i["id"]))
                size = min(int(query.get("pageSize", 100)), server.max_page)
                start = int(query.get("pageToken", 0) or 0)
                page = items[start:start + size]
                fields = query.get("fields", "")
                inner = re.search(r"files\(([^)]*)\)", fields)
                body = {"files": [apply_fields(i, inner.group(1) if inner else None) for i in page]}
                if start + size < len(items) and (not fields or "nextPageToken" in fields):
                    body["nextPageToken"] = str(start + size)
                self._answer(200, body)

            def do_DELETE(self):
                if self._fault():
                    return
                match = re.fullmatch(r"/drive/v3/files/([^/?]+)", urlparse(self.path).path)
                path = server._path_of(match.group(1)) if match else None
                if path is None:
                    return self._answer(404, {"error": {"code": 404, "message": "File not found."}})
                if os.path.isdir(path):
                    shutil.rmtree(path)
                else:
                    os.remove(path)
                self._answer(204, None)

        return Handler


def _item(item_id: str, name: str, parent: str | None, mime: str | None, data: bytes | None = None,
          trashed: bool = False, path: str | None = None) -> dict:
    item = {"kind": "drive#file", "id": item_id, "name": name, "mimeType": mime or "application/octet-stream",
            "parents": [parent] if parent else [], "trashed": trashed}
    if path is not None:
        with open(path, "rb") as fh:
            item["md5Checksum"] = hashlib.file_digest(fh, "md5").hexdigest()
        stat = os.stat(path)
        item["size"] = str(stat.st_size)  # Drive sends sizes as strings (int64 in JSON)
        item["modifiedTime"] = datetime.fromtimestamp(stat.st_mtime, timezone.utc).isoformat().replace("+00:00", "Z")
    elif data is not None and mime != FOLDER:
        item["md5Checksum"], item["size"] = hashlib.md5(data).hexdigest(), str(len(data))
    return item


def _holds(item: dict, term: tuple[str, str, str]) -> bool:
    field, op, value = term
    if field == "parents":
        return value in item["parents"] or (value == "root" and "cloud-root" in item["parents"])
    if field == "trashed":
        return item["trashed"] == (value == "true")
    actual = item["name"] if field == "name" else item["mimeType"]
    return (actual == value) if op == "=" else (actual != value)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cloud", required=True)
    parser.add_argument("--trash", required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--fail", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    server = DriveApiServer(args.cloud, args.trash, fail=args.fail, seed=args.seed, port=args.port)
    print(f"LISTENING {server.url}", flush=True)
    server.httpd.serve_forever()


if __name__ == "__main__":
    main()
