"""The one gate for every deletion: nothing that may be the only copy of a checkpoint is removed,
truncated, replaced or moved except here, and only on a proof taken at that moment.

Pruning, the Trash-free truncate-then-delete, Drive API deletes, archiving (`resume=False`) and a
re-publish over a folder that holds another checkpoint all come here (`CheckpointGate`); a rewrite
of lease.json asks `act` with the lease's own proof (`lease.py`). Each is allowed only when every
proof holds *now*, read afresh, never remembered:

  (a) a newer checkpoint is in the cloud now, by the folder's own evidence: DriveFS's attributes, or
      Drive's API, read now; on a plain folder, the newer checkpoint verifies now. On a Drive that
      shows neither, no rate is guessed: the proof is a checkpoint *written before* it that verifies
      now (a VM uploads files in the order they were written, so whatever of the later one reached the
      cloud, the earlier one reached first; and since every deletion needs an earlier one, the run's
      first checkpoint that verifies is never deleted there). "Written before" is never read off a
      clock (`evidence.py`). A target that holds no checkpoint (`Evidence.holds_no_checkpoint`: a
      manifest read whole that does not match, or a listed file missing at every look and for minutes)
      loses nothing a resume could use: any other checkpoint safe now, by the same evidence, vouches for
      its deletion, and a new checkpoint of its step may be written over it without one;
  (b) the target is the object that was chosen: the same resolved path and the same manifest bytes
      (through the API: the folder's id found afresh from Drive's root, and its manifest's md5 there);
  (c) this runtime holds the lease (`Lease.check()` is True, not unknown).

On the Hub a new VM's older checkpoints arrive after the resume began (`hub/fill.py`); until one has, the rules
see it as the Hub holds it (`elsewhere`), and (b) reads its manifest there.

Anything short of that keeps the folder and journals `kept` with the reason; the next pass looks again.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from ..checkpoints import storage, validity
from ..checkpoints.manifest import MANIFEST, Manifest, parse_manifest
from .deleters import ApiDeleter, HubDeleter, TrashFreeDeleter
from .drivefs import API, DRIVEFS, HUB, PLAIN, UNCONFIRMED, in_cloud, read_upload
from .evidence import Evidence
from .uploads import cloud_files

__all__ = ["Chosen", "choose", "act", "CheckpointGate"]

log = logging.getLogger(__name__)

Proof = Callable[[], "str | None"]  # a fresh read: None when it holds now, else why not


@dataclass(frozen=True)
class Chosen:
    """A checkpoint folder as it was when a rule chose it (to delete, or as the witness that allows it)."""

    step: int
    path: Path
    resolved: Path
    manifest_raw: bytes | None  # its MANIFEST.json as read then (None: it had none)
    written_at: float  # when its manifest (or, without one, the folder) was last written, by the mount
    remote: bool = False  # on the Hub, not yet in the replica (`CheckpointGate.elsewhere`)

    @property
    def manifest_md5(self) -> str | None:
        return hashlib.md5(self.manifest_raw).hexdigest() if self.manifest_raw is not None else None

    @property
    def manifest(self) -> Manifest | None:
        return parse_manifest(self.manifest_raw)


def choose(path: Path, step: int) -> Chosen:
    """What `path` is now (read it: resolved path, manifest bytes, write time).

    Raises:
        OSError: it could not be read (nothing can be chosen on an unknown).
    """
    path = Path(path)
    try:
        raw = storage.read_bytes(path / MANIFEST)
        written = storage.stat(path / MANIFEST).st_mtime
    except FileNotFoundError:
        raw, written = None, storage.stat(path).st_mtime
    return Chosen(step, path, storage.resolve(path), raw, written)


def act(action: str, target: str, proofs: Iterable[Proof], do: Callable[[], object], *, journal=None,
        on_kept: Callable[[str], None] | None = None) -> bool:
    """Do `do()` when every proof holds now; else keep `target`, journal `kept` with the first reason
    that fails, and return False. The one place where a deletion or an overwrite is decided."""
    for proof in proofs:
        why = proof()
        if why is not None:
            log.info("kept %s (%s not done): %s", target, action, why)
            if on_kept is not None:
                on_kept(why)
            elif journal is not None:
                journal.write("kept", target=target, action=action, reason=why)
            return False
    do()
    return True


class CheckpointGate:
    """The deletions and replacements of one run folder's checkpoints.

    Args:
        root: the folder of `checkpoint-<step>` folders.
        kind: the folder's kind (`drivefs`: DRIVEFS, UNCONFIRMED, PLAIN; or API).
        lease_check: `Lease.check` (True, False or None), or None for a folder without a lease.
        api: the `driveapi.DriveApi` of kind API, which confirms and deletes for good.
    """

    def __init__(self, root: Path, *, kind: str, journal, lease_check: Callable[[], bool | None] | None = None,
                 api=None, lease=None):
        self.root, self.kind, self.journal, self.api = Path(root), kind, journal, api
        self.lease_check, self.lease = lease_check, lease
        self.deleter = ApiDeleter(api) if kind == API else HubDeleter(api) if kind == HUB else TrashFreeDeleter(kind)
        self._told: dict[str, str] = {}  # target -> the reason last journaled as kept (said once)
        self.evidence = Evidence()  # the order of writes, and what holds no checkpoint

    @property
    def pending(self) -> list[Path]:
        return self.deleter.pending

    def elsewhere(self) -> dict[int, tuple[Chosen, bool]]:
        """The run's checkpoints that the store holds and the folder does not yet: on the Hub, a new VM's older
        ones on their way (`hub/fill.py`): step -> (as chosen now, whole there). Empty on every other kind."""
        if self.kind != HUB:
            return {}
        return {step: (Chosen(step, self.root / f"checkpoint-{step}", self.root / f"checkpoint-{step}", raw, 0.0,
                              remote=True), whole)
                for step, (raw, whole) in self.api.fill.elsewhere().items()}

    def in_cloud_elsewhere(self) -> set[int]:
        """The checkpoints the store itself proves in the cloud without the tracker (on the Hub: whole at the head
        a new VM started from, arrived or not); empty on every other kind."""
        return self.api.fill.whole_steps() if self.kind == HUB else set()

    def poll(self) -> list[Path]:
        """Finish what was allowed and started (the Trash-free unlink after the truncation reached the cloud),
        while the lease is still this runtime's: once it is not, the new owner's rules finish it."""
        if self.deleter.pending and self.lease_check is not None and self.lease_check() is not True:
            return []
        return self.deleter.poll()

    # -- operations ----------------------------------------------------------------------------------
    def delete(self, target: Chosen, witness: Chosen | None, *, because: str) -> bool:
        """Delete checkpoint `target`, on the proof that `witness` gives (see the module docstring).
        Journals `prune` before the first file goes; False when kept."""
        proofs = [self._lease_held, lambda: self._same(target), lambda: self._witnessed(target, witness)]

        def delete_now():
            self.journal.write("prune", steps=[target.step], because=because, witness=witness.step,
                               trash_free=self.deleter.kind != PLAIN)
            validity.forget(target.path)
            self.deleter.start(target.path, first=MANIFEST, manifest_md5=target.manifest_md5)

        return act("delete", target.path.name, proofs, delete_now, on_kept=lambda why: self._kept(target, why))

    def replace(self, target: Chosen, witness: Chosen | None, write: Callable[[], object]) -> str | None:
        """Write another checkpoint of the same step over `target` (`write()`), on the same proofs as a
        deletion: the one there now may be the only copy of its training in the cloud. Over a folder that holds
        no checkpoint now, no witness is needed. Returns None when written, else why it was kept."""
        def vouched() -> str | None:  # over a folder that holds no checkpoint, nothing is lost
            why = self._witnessed(target, witness)
            return None if why is None or self.evidence.holds_no_checkpoint(target) else why

        def write_now():
            self.evidence.wrote(target.path)
            write()

        kept = []

        def on_kept(why: str) -> None:
            kept.append(why)
            self._kept(target, why)

        proofs = [self._lease_held, lambda: self._same(target), vouched]
        return None if act("replace", target.path.name, proofs, write_now, on_kept=on_kept) else kept[0]

    def archive(self, checkpoints: Path, to: Path) -> bool:
        """Move the checkpoints folder to `to` (nothing is deleted; a fresh start). The API's ids of the
        moved folders are forgotten: an id belongs to one folder instance, not to a path."""

        def move():
            storage.make_dirs(to.parent)
            storage.replace(checkpoints, to)
            storage.make_dirs(checkpoints)
            if self.api is not None:
                self.api.forget(checkpoints)
            validity.forget_under(checkpoints)

        return act("archive", str(checkpoints), [self._lease_held], move, journal=self.journal)

    # -- proofs ------------------------------------------------------------------------------------
    def _lease_held(self) -> str | None:
        if self.lease_check is None:
            return None
        held = self.lease_check()
        if held is not True:
            return "the lease is another runtime's now" if held is False else "the lease could not be confirmed now"
        if self.lease is None:
            return None
        quiet = self.lease.quiet_left()
        if quiet > 0:
            return (f"this runtime took the run over a moment ago; nothing is deleted for {quiet:.0f} s more, until "
                    f"the runtime it replaced has had a heartbeat to see that")
        if self.kind not in (DRIVEFS, API):
            return None
        path = self.lease.path
        try:  # the lease as this runtime reads it is the one in the cloud: every other runtime can see it
            raw = storage.read_bytes(path)
            md5 = hashlib.md5(raw).hexdigest()
            if self.kind == API:
                there = [item.get("md5Checksum") for item in self.api.children(path.parent).get(path.name, [])]
                up = there == [md5]
            else:
                up = read_upload(path).in_cloud(md5)
        except Exception as exc:  # noqa: BLE001 - a failed read is unknown (OSError, ApiUnavailable, ...)
            return f"whether the lease is in the cloud could not be read now ({exc})"
        return None if up else "this runtime's lease is not in the cloud yet (others cannot see it)"

    def _same(self, chosen: Chosen) -> str | None:
        """(b) `chosen.path` is still the folder that was chosen."""
        if chosen.remote:
            return self.api.fill.same_there(chosen.step, chosen.manifest_raw)
        try:
            now = choose(chosen.path, chosen.step)
        except OSError as exc:
            return f"{chosen.path.name} could not be read again ({exc.strerror or exc})"
        if now.resolved != chosen.resolved:
            return f"{chosen.path} leads elsewhere now ({now.resolved})"
        if now.manifest_raw != chosen.manifest_raw:
            return f"{chosen.path.name}'s manifest changed since it was chosen"
        return None

    def _witnessed(self, target: Chosen, witness: Chosen | None) -> str | None:
        """(a) for `target`: `witness` is in the cloud now (confirmed kinds), or older and valid now."""
        if witness is None:
            return "no checkpoint vouches for it"
        if witness.path == target.path:
            return "a checkpoint cannot vouch for itself"
        moved = self._same(witness)
        if moved is not None:
            return moved
        verdict = validity.check(witness.path, step=witness.step)
        if not verdict.valid:
            return f"{witness.path.name} does not verify now ({verdict})"
        why = self._vouches(target, witness, verdict.manifest)
        if why is None or target.remote or not self.evidence.holds_no_checkpoint(target):
            return why
        # It holds no checkpoint: a witness safe now is enough, newer or older (read last: it reads the target).
        return None if self.kind in (UNCONFIRMED, PLAIN) else self._in_cloud_now(witness, verdict.manifest)

    def _vouches(self, target: Chosen, witness: Chosen, manifest: Manifest) -> str | None:
        """The rule of the folder's kind, for a `witness` that verifies now: None when it vouches for `target`."""
        if self.kind == UNCONFIRMED:
            if not self.evidence.write_order(witness) < self.evidence.write_order(target):
                return f"{witness.path.name} was not written before it (nothing here confirms uploads)"
            return None
        if witness.step <= target.step:
            return f"{witness.path.name} is not newer"
        if self.kind == PLAIN:
            return None
        return self._in_cloud_now(witness, manifest)

    def _in_cloud_now(self, witness: Chosen, manifest: Manifest) -> str | None:
        try:
            if self.kind == API:
                sizes = {name: entry.size for name, entry in manifest.files.items()}
                expected = {name: (sizes[name], md5) for name, md5 in cloud_files(witness.path, manifest).items()
                            if name in sizes}
                expected[MANIFEST] = (len(witness.manifest_raw), witness.manifest_md5)
                done, _ = self.api.confirm(witness.path, expected)
            elif self.kind == DRIVEFS:
                done, _ = in_cloud(witness.path, cloud_files(witness.path, manifest), DRIVEFS)
            elif self.kind == HUB:  # the Hub's listing now, nothing committed for it
                done, _ = self.api.confirm(witness.path, manifest, push=False)
            else:
                return f"nothing confirms uploads on a folder of kind {self.kind}"
        # A failed read (OSError, ApiUnavailable, an ambiguous folder) is unknown.
        except Exception as exc:  # noqa: BLE001
            return f"whether {witness.path.name} is in the cloud could not be read now ({exc})"
        return None if done else f"{witness.path.name} is not in the cloud now"

    def _kept(self, target: Chosen, why: str) -> None:
        key = str(target.path)
        if self._told.get(key) != why:
            self._told[key] = why
            self.journal.write("kept", step=target.step, reason=why)
