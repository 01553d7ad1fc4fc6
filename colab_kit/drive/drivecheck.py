"""`ck.drive_check()` / `python -m colab_kit drive-check`: what Drive really reports, measured.

Nobody has yet shown DriveFS's upload attributes on Colab's mount (`drivefs.py`). This check
writes a test file, reads the attributes every second until the file is committed, deletes it
the Trash-free way and prints JSON: which attributes exist, their values over time, the time to
commit and the upload rate, and, where Drive's API is available, how long the file took to show
its md5 there. Its output is how a user shows what the kit can rely on.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import uuid
from pathlib import Path

from .._units import format_bytes
from ..checkpoints.clock import clock
from .drivefs import ITEM_ID, MD5, UNCOMMITTED, is_drive_mount

__all__ = ["drive_check"]

_ATTRS = (UNCOMMITTED, ITEM_ID, MD5)
_CHUNK = 8 << 20


def _default_folder() -> Path:
    from .mount import resolve_root

    return resolve_root()[0]


def _read(path: Path) -> dict:
    values = {}
    for name in _ATTRS:
        try:
            values[name] = os.getxattr(path, name).decode(errors="replace")
        except OSError as exc:
            values[name] = None if exc.errno in (errno.ENODATA, errno.ENOTSUP) else f"error: {exc.strerror}"
    return values


def _watch(path: Path, until, interval: float, timeout: float) -> tuple[list[dict], float | None]:
    """Sample the attributes until `until(values)`; returns (timeline of changes, seconds to it).

    The time is the midpoint between the last sample before and the first after, so it is off
    by at most half an interval.
    """
    started = clock.monotonic()
    timeline, last, before = [], None, 0.0
    while True:
        now = clock.monotonic() - started
        values = _read(path)
        if values != last:
            timeline.append({"t": round(now, 2), **values})
            last = values
        if until(values):
            return timeline, (before + now) / 2
        if now >= timeout:
            return timeline, None
        before = now
        clock.sleep(interval)


def _api_for(api, folder: Path):
    """The Drive API to time (given, from the environment, or Colab's granted credentials), or the
    reason there is none. Never asks for consent: `start_run(confirm="api")` does."""
    from .driveapi import COLAB_ROOT, DriveApi, unavailable_message

    if api is None:
        api = DriveApi.from_environment()
    if api is None and str(folder.absolute()).startswith(COLAB_ROOT):
        api = DriveApi(root=COLAB_ROOT)
    if api is None:
        return None, "no Drive API given (COLAB_KIT_DRIVE_API, or api=ck.DriveApi(...))"
    try:
        api.folder_id(folder)
    except Exception as exc:  # noqa: BLE001 - reported, not raised: this is a check
        return None, (f"{api.describe()} cannot be used ({unavailable_message(exc)}); in Colab, "
                      f"ck.start_run(..., confirm='api') asks for access")
    return api, None


def _api_md5_s(api, path: Path, md5: str, interval: float, timeout: float, started: float) -> float | None:
    """Seconds from the end of the write until the API lists `path` with `md5` (None: not within timeout)."""
    while clock.monotonic() - started < timeout:
        try:
            items = api.children(path.parent).get(path.name, [])
            if any(item.get("md5Checksum") == md5 for item in items):
                return clock.monotonic() - started
        except OSError:  # not there yet, or the API did not answer: look again
            pass
        clock.sleep(interval)
    return None


def drive_check(folder: str | os.PathLike | None = None, *, size_mb: float = 100, interval: float = 1.0,
                timeout: float = 900, quiet: bool = False, api=None) -> dict:
    """Measure Drive's upload reporting on `folder` (default: the kit's folder on Drive).

    Writes a `size_mb` MB file of random bytes, reads DriveFS's attributes every `interval`
    seconds until the file is committed (or `timeout`), then deletes it: truncate to 0 bytes,
    wait until that is committed, unlink (so the Trash keeps an empty stub).

    Also says whether Drive's API can confirm uploads here (`api`, default: COLAB_KIT_DRIVE_API,
    or Colab's credentials once granted) and, where it can, how long the fresh file took to show
    the right md5 through it.

    Returns:
        The report (also printed as JSON unless `quiet`): attributes present, their timeline,
        seconds to commit and the upload rate (bytes/s; None when it never committed or the
        attributes are missing), the API's answer, and the folder's free space as statvfs reports it.
    """
    folder = Path(folder) if folder is not None else _default_folder()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f".colab_kit-drive-check-{uuid.uuid4().hex[:8]}.bin"
    size = int(size_mb * 1e6)
    report: dict = {"folder": str(folder.absolute()), "drive_mount": is_drive_mount(folder), "bytes": size}
    started = clock.monotonic()
    digest = hashlib.md5()
    with open(path, "wb") as fh:
        left = size
        while left:
            block = os.urandom(min(_CHUNK, left))
            fh.write(block)
            digest.update(block)
            left -= len(block)
        fh.flush()
        os.fsync(fh.fileno())
    report["write_s"] = round(clock.monotonic() - started, 2)
    written = clock.monotonic()
    try:
        first = _read(path)
        report["attributes"] = {name: first[name] is not None for name in _ATTRS}
        if first[UNCOMMITTED] is None:
            report.update(timeline=[{"t": 0.0, **first}], commit_s=None, upload_bytes_per_s=None,
                          verdict="no DriveFS upload attributes here: the kit cannot confirm uploads on this "
                                  "folder (plain folder, or a Drive mount that does not report them)")
        else:
            def committed(values):
                return values[UNCOMMITTED] == "0" and not (values[ITEM_ID] or "local-").startswith("local-")

            timeline, seconds = _watch(path, committed, interval, timeout)
            report.update(timeline=timeline, commit_s=round(seconds, 2) if seconds is not None else None,
                          upload_bytes_per_s=round(size / seconds) if seconds else None)
            report["verdict"] = (f"committed after {seconds:.1f} s: about {format_bytes(size / seconds)}/s"
                                 if seconds else f"not committed within {timeout:.0f} s")
        usable, why = _api_for(api, folder)
        report["api"] = {"available": usable is not None, "why": why}
        if usable is not None:
            seconds = _api_md5_s(usable, path, digest.hexdigest(), interval, timeout, written)
            report["api"].update(endpoint=usable.describe(), md5_s=round(seconds, 2) if seconds is not None else None,
                                 calls=usable.calls)
    finally:
        report["delete"] = _delete(path, report.get("attributes", {}).get(UNCOMMITTED), interval, timeout)
    st = os.statvfs(folder)
    report["free_bytes"] = st.f_bavail * st.f_frsize if st.f_blocks else None
    if not quiet:
        print(json.dumps(report, indent=1))
    return report


def _delete(path: Path, has_attributes: bool | None, interval: float, timeout: float) -> dict:
    os.truncate(path, 0)
    result: dict = {"truncated": True}
    if has_attributes:
        timeline, seconds = _watch(path, lambda v: v[UNCOMMITTED] == "0", interval, timeout)
        result.update(truncate_commit_s=round(seconds, 2) if seconds is not None else None, timeline=timeline)
    path.unlink()
    result["unlinked"] = True
    return result
