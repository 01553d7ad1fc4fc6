"""Is a checkpoint folder valid? One answer for resume, pruning, `status` and the mirror.

A folder is VALID when its MANIFEST.json parses, names its own step, lists every file a sharded
checkpoint needs (`shards.py`), and every file it lists exists with the listed size and sha256. A
verdict is one of four, and only two of them are facts:

    VALID        read completely and matching: it may be resumed from, kept and counted
    INVALID      read completely and not matching, on positive evidence: a file of another size, bytes
                 whose sha256 differs (read twice, the same), a manifest read whole that does not parse
                 (twice) or names another step. It is never resumed from, counted or called in the cloud
    UNFINISHED   no MANIFEST.json at this look: a save or upload that did not finish (or one in
                 progress), or a manifest Drive hides for a moment (`absent`)
    UNKNOWN      a read failed (EIO, errno 107, a stall that timed out, a torn read, a full local disk
                 while fetching), or a file the manifest lists is missing at this look (`absent`):
                 nothing is known, so nothing may be decided from it. It costs time (look again
                 later), never a deletion, a takeover or a claim.

Absence is not evidence (`looks.py`): a missing manifest or file is one look's answer. `settled`
looks again, spaced in time, before a caller acts on it; and a checkpoint once confirmed in the cloud
(the journal says so) never becomes INVALID by absence, however many looks agree.

Hashing a multi-GB checkpoint on Drive is slow, so verdicts are cached per manifest: keyed by the
folder, the manifest's own sha256 and every file's (size, mtime). A later check of an unchanged
folder only stats its files. The mirror records what it has just published and read back, and a
fetch records what it hashed while copying, so most checks are stats.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from pathlib import Path

from . import looks, shards, storage
from .manifest import MANIFEST, Manifest

__all__ = ["VALID", "INVALID", "UNFINISHED", "UNKNOWN", "SIZES_MATCH", "Verdict", "check", "settled", "verify_folder",
           "remember", "forget", "forget_under"]

VALID, INVALID, UNFINISHED, UNKNOWN = "valid", "invalid", "unfinished", "unknown"
SIZES_MATCH = "every file has its size; the bytes are not read yet"


@dataclass(frozen=True)
class Verdict:
    state: str
    reason: str = ""
    manifest: Manifest | None = None
    absent: bool = False  # the answer of one look that found something missing (never a fact by itself)

    @property
    def valid(self) -> bool:
        return self.state == VALID

    @property
    def unknown(self) -> bool:
        return self.state == UNKNOWN

    def __str__(self) -> str:
        return self.state + (f": {self.reason}" if self.reason else "")


_lock = threading.Lock()
_cache: dict[tuple[str, str], tuple[dict, Verdict]] = {}  # (folder, manifest sha256) -> (stamps, verdict)


def _unknown(what: str, exc: OSError) -> Verdict:
    return Verdict(UNKNOWN, f"could not read {what} ({exc.strerror or exc})")


def _read_manifest(folder: Path) -> tuple[Verdict | None, Manifest | None, str]:
    """(a final verdict, or None to go on; the manifest; its sha256)."""
    try:
        raw = storage.read_bytes(folder / MANIFEST)
    except FileNotFoundError:
        return Verdict(UNFINISHED, "no MANIFEST.json (the save or upload did not finish)", absent=True), None, ""
    except OSError as exc:
        return _unknown(MANIFEST, exc), None, ""
    try:
        manifest = Manifest.from_json(json.loads(raw))
    except (ValueError, KeyError, TypeError) as exc:
        # Evidence only when read whole, twice alike: a torn read returns part of the file.
        try:
            whole = len(raw) == storage.stat(folder / MANIFEST).st_size and storage.read_bytes(folder / MANIFEST) == raw
        except OSError as again:
            return _unknown(MANIFEST, again), None, ""
        if not whole:
            return Verdict(UNKNOWN, "MANIFEST.json was not read whole (a torn read)"), None, ""
        return Verdict(INVALID, f"unreadable MANIFEST.json ({exc})"), None, ""
    return None, manifest, hashlib.sha256(raw).hexdigest()


def _stamps(folder: Path, manifest: Manifest) -> tuple[Verdict | None, dict]:
    stamps = {}
    for name, entry in manifest.files.items():
        try:
            st = storage.stat(folder / name)
        except FileNotFoundError:
            return _missing(name, manifest), {}
        except OSError as exc:
            return _unknown(name, exc), {}
        if st.st_size != entry.size:
            return Verdict(INVALID, f"{name} has {st.st_size} bytes, the manifest says {entry.size} (truncated?)",
                           manifest), {}
        stamps[name] = (st.st_size, st.st_mtime_ns)
    return None, stamps


def check(folder: str | Path, *, step: int | None = None, hashes: bool = True) -> Verdict:
    """The verdict on `folder` (a `checkpoint-<step>` folder, or `final/`); `step`, when given, is the
    step its name says, which the manifest must say too.

    `hashes=False` reads no file's bytes: a folder not known yet whose sizes all match then gets
    UNKNOWN with the reason `SIZES_MATCH` and its manifest (for a folder about to be read anyway: a
    fetch hashes while it copies; or for a quick look)."""
    folder = Path(folder)
    verdict, manifest, digest = _read_manifest(folder)
    if verdict is not None:
        return verdict
    if step is not None and manifest.step != step:
        return Verdict(INVALID, f"its manifest is for step {manifest.step}, not {step}", manifest)
    incomplete = shards.layout_problem(manifest.files, manifest.shards)
    if incomplete is not None:  # the manifest itself, read whole, says a shard or .metadata is not there
        return Verdict(INVALID, incomplete, manifest)
    verdict, stamps = _stamps(folder, manifest)
    if verdict is not None:
        return verdict
    key = (str(folder.absolute()), digest)
    with _lock:
        cached = _cache.get(key)
    if cached is not None and cached[0] == stamps:
        return cached[1]
    if not hashes:
        return Verdict(UNKNOWN, SIZES_MATCH, manifest)
    for name, entry in manifest.files.items():
        try:
            sha = storage.sha256_file(folder / name)
            if sha != entry.sha256 and storage.sha256_file(folder / name) != sha:  # evidence: the same twice
                return Verdict(UNKNOWN, f"{name} read differently twice (a torn read)", manifest)
        except FileNotFoundError:
            return _missing(name, manifest)
        except OSError as exc:
            return _unknown(name, exc)
        if sha != entry.sha256:
            return _remember(key, stamps, Verdict(INVALID, f"{name} does not match its sha256 (corrupted)", manifest))
    return _remember(key, stamps, Verdict(VALID, "", manifest))


def _missing(name: str, manifest: Manifest) -> Verdict:
    return Verdict(UNKNOWN, f"{name} is missing at this look", manifest, absent=True)


def settled(folder: str | Path, *, step: int | None = None, confirmed: bool = False, waits=None) -> Verdict:
    """`check`, looked at again (`looks.again`) while something is missing, so that an absence is
    acted on only when every look agreed.

    Then: no manifest at any look is UNFINISHED; a listed file missing at every look is INVALID for a
    checkpoint never confirmed in the cloud (an upload that died with its runtime), and stays UNKNOWN
    for one that was (`confirmed`: the journal says so), which only positive evidence makes invalid."""
    verdict = looks.again(lambda: check(folder, step=step), lambda v: v.absent, waits)
    if verdict.state == UNKNOWN and verdict.absent and not confirmed:
        reason = verdict.reason.replace("at this look", f"at every look over {looks.span(waits):.0f} s")
        return Verdict(INVALID, reason, verdict.manifest)
    return verdict


def verify_folder(folder: str | Path) -> str | None:
    """None when `folder` is VALID, else why not (the verdict's reason: invalid, unfinished or unknown)."""
    verdict = check(folder)
    return None if verdict.valid else verdict.reason


def _remember(key, stamps: dict, verdict: Verdict) -> Verdict:
    with _lock:
        _cache[key] = (stamps, verdict)
    return verdict


def remember(folder: str | Path, manifest: Manifest, *, valid: bool, reason: str = "") -> None:
    """Record a verdict reached while reading every byte anyway (a publish read back, a fetch that
    hashed while copying), so that the next `check` of the unchanged folder only stats it."""
    folder = Path(folder)
    try:
        digest = hashlib.sha256(storage.read_bytes(folder / MANIFEST)).hexdigest()
        verdict, stamps = _stamps(folder, manifest)
    except OSError:
        return  # not known for sure: the next check reads it
    if verdict is None:
        _remember((str(folder.absolute()), digest), stamps,
                  Verdict(VALID if valid else INVALID, reason, manifest))


def forget(folder: str | Path) -> None:
    """Drop what is known of `folder` (it is being deleted or replaced)."""
    prefix = str(Path(folder).absolute())
    with _lock:
        for key in [k for k in _cache if k[0] == prefix]:
            del _cache[key]


def forget_under(root: str | Path) -> None:
    """Drop what is known of every folder under `root` (moved away: the archive of a fresh start)."""
    prefix = str(Path(root).absolute()) + "/"
    with _lock:
        for key in [k for k in _cache if k[0].startswith(prefix)]:
            del _cache[key]


def clear() -> None:
    """Forget every verdict (the simulator starts each schedule with nothing known)."""
    with _lock:
        _cache.clear()
