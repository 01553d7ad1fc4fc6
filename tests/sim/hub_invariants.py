"""The invariants of the simulator's Hub world (`hubworld.py`), judged on the Hub's head after every event and at
every commit (`HubInvariants.before_commit`, called by the simulated Hub before a commit lands):

  I1  once a checkpoint was whole on the Hub, one always is;
  I2  no `cloud` claim is false when made (the head shows every file with the manifest's sha256);
  I3  no commit lands that carries a lease other than the one at its parent's head, unless it is a claim (the
      fencing: a runtime taken over never lands a commit), nor one of a runtime not holding the lease, but for a
      watcher's mark beside the lease (`hub/leasewatch.py`);
  I4  a resume picks the newest checkpoint whole on the Hub (or newer), never an older one or a fresh start;
  I5  no commit deletes a checkpoint whole on the Hub unless a newer one is whole there and stays;
  I6  a runtime that runs and beats is never taken over unasked: not while it uploads a checkpoint, nor within a
      heartbeat of its lease's last commit, the time the Hub took no commit from anyone not counted;
  I9  the Hub's journal only grows, and the lines a kernel restart left in the replica reach it;
  I10 final/ on the Hub is one export, never a union of two; the one a new export replaces is kept in archive/
      on the Hub; and at the end the holder's last export is final/;
  I7, I8 at the end: what the holder saved last is whole on the Hub, and no more checkpoints are left than keep.
"""

from __future__ import annotations

import hashlib
import json
import re

from invariants import Invariants

__all__ = ["HubInvariants", "whole_steps"]

_STEP = re.compile(r"^run/checkpoints/checkpoint-(\d+)/")


class HubInvariants(Invariants):
    """The invariants judged on the Hub's head (module docstring)."""

    def __init__(self, world):
        super().__init__(world)
        self._head = None

    def _files(self) -> dict:
        try:
            return self.w.hub.state.commit_log("user/runs")[0].files
        except Exception:  # noqa: BLE001 - no repo yet
            return {}

    def complete_steps(self) -> set[int]:
        files = self._files()
        head = id(files)
        if head != self._head:
            self._head, self._complete = head, whole_steps(files)
        return self._complete

    def _view_lease(self, rt):
        return _lease(self._files())  # the Hub's head is what every runtime sees

    def before_change(self, op: str, path: str, data: bytes | None = None) -> None:
        return  # no Drive folder here: what changes the run is a commit (`before_commit`)

    def before_commit(self, before: dict, after: dict, ops) -> None:
        rt = self.w.fs.actor
        lease_then, lease_now = _lease(before), _lease(after)
        if lease_then is not None and lease_now is not None and lease_now[0] != lease_then[0] and not lease_then[1]:
            if rt is None or not rt.acquiring:
                self.violate("I3", f"{rt} commits over lease {lease_then[0]}'s with its own, not as a claim")
            else:
                self._claimed_from(rt, lease_then[0])
        if lease_then is not None and lease_now is not None and lease_now[0] == lease_then[0] and rt is not None \
                and rt.session != lease_now[0] and not (rt.acquiring and _only_the_watch_mark(before, after)):
            self.violate("I3", f"{rt} commits while the lease is {lease_then[0]}'s")
        lost = _lines(before) - _lines(after)
        if lost and "run/events.jsonl" in after:
            self.violate("I9", f"{rt} commits a journal without {len(lost)} line(s) the Hub's held, "
                               f"e.g. {sorted(lost)[0][:80]}")
        self._judge_final(rt, before, after)
        was, will = whole_steps(before), whole_steps(after)
        gone = was - will
        if gone and not any(s > max(gone) for s in will):
            self.violate("I5", f"{rt} commits away checkpoint(s) {sorted(gone)} whole on the Hub, leaving "
                               f"{sorted(will) or 'none'} whole")

    def _judge_final(self, rt, before: dict, after: dict) -> None:
        """I10 at a commit: final/ holds one export, never a union of two; the one it replaces is kept in
        archive/ on the Hub."""
        old, new = _final(before), _final(after)
        if new is not None and set(new[1]) != set(new[0]):
            extra = sorted(set(new[1]) - set(new[0]))
            self.violate("I10", f"{rt} commits a final/ that is not one export: {extra or 'files missing'} beside "
                                f"what its manifest names")
        if old is not None and new is not None and old[0] != new[0]:
            archived = {_sha(entry) for path, entry in after.items() if path.startswith("run/archive/")}
            lost = [name for name, sha in old[0].items() if sha not in archived]
            if lost:
                self.violate("I10", f"{rt} commits a new final/ and the export it replaces is not kept on the Hub "
                                    f"(archive/ lacks {lost[:2]})")

    def _claimed_from(self, rt, session: str) -> None:
        """I6 at the commit that claims the run: the holder it replaces must not be running and beating, unless
        the claim was asked for (takeover=True). Judged here, not from what the claimer read: a read that failed
        and was taken for "no lease" would hide the holder."""
        holder = next((other for other in self.w.runtimes if other.session == session), None)
        if rt.asked or holder is None or not holder.alive or holder.run is None:
            return
        landed = self.w.lease_landed.get(session)
        beat, now = self.w.s.heartbeat_s, self.w.clock.t
        if holder.uploading:
            self.violate("I6", f"{rt} claims the run from {holder}, which runs and uploads a checkpoint now (its "
                               f"heartbeat goes on beside the upload)")
        elif landed is not None and now - landed - self.w.hub.refused_between(landed, now) < beat:
            refused = self.w.hub.refused_between(landed, now)
            self.violate("I6", f"{rt} claims the run from {holder}, which runs and whose lease reached the Hub "
                               f"{now - landed:.0f} s ago (a commit at least every {beat:.0f} s), "
                               f"{refused:.0f} s of which the Hub took no commit from anyone")

    def settled(self, rt) -> list[tuple[str, str]]:
        complete = self.complete_steps()
        if rt.saved is not None and rt.saved not in complete and not any(step > rt.saved for step in complete):
            return [("I7", f"{rt} saved checkpoint-{rt.saved} last, and with every fault healed it is not whole on "
                           f"the Hub (whole there: {sorted(complete)})")]
        final = _final(self._files())
        if rt.exported is not None and (final is None or final[0] != rt.exported):
            return [("I10", f"{rt} exported final/ last, and with every fault healed the Hub's final/ is not that "
                            f"export")]
        owed = getattr(rt, "owed", set()) - _lines(self._files())
        if owed:
            return [("I9", f"{rt} found {len(owed)} journal line(s) in its replica at its start (a kernel restart's) "
                           f"that never reached the Hub, e.g. {sorted(owed)[0][:80]}")]
        folders = {int(m.group(1)) for p in self._files() if (m := _STEP.match(p))}
        mine = rt.saved if rt.saved is not None else rt.resumed
        above = {f for f in folders if mine is None or f > mine}
        bound = rt.run.mirror.keep + 1
        if len(folders) > bound + len(above):
            return [("I8", f"{len(folders)} checkpoints are left on the Hub ({sorted(folders)}); keep="
                           f"{rt.run.mirror.keep} keeps {bound}, and {len(above)} are newer than any it saved")]
        return []


def _final(files: dict):
    """(what final/'s manifest names: name -> sha256, what final/ holds: name -> sha256) on the Hub, or None."""
    entry = files.get("run/final/MANIFEST.json")
    if entry is None:
        return None
    try:
        named = {name: want["sha256"] for name, want in json.loads(entry.content)["files"].items()}
    except (ValueError, KeyError, TypeError):
        return None
    held = {path[len("run/final/"):]: _sha(f) for path, f in files.items()
            if path.startswith("run/final/") and path != "run/final/MANIFEST.json"}
    return named, held


def _sha(entry) -> str:
    return entry.sha256 or hashlib.sha256(entry.content).hexdigest()


def _lines(files: dict) -> set[bytes]:
    entry = files.get("run/events.jsonl")
    return {line for line in entry.content.splitlines() if line.strip()} if entry is not None else set()


def _lease(files: dict):
    entry = files.get("run/lease.json")
    if entry is None:
        return None
    try:
        lease = json.loads(entry.content)
        return lease["session"], bool(lease.get("released"))
    except (ValueError, KeyError, TypeError):
        return None


def whole_steps(files: dict) -> set[int]:
    """The checkpoints the snapshot `files` holds whole: a manifest, and every file it names with its sha256."""
    steps = set()
    for path, entry in files.items():
        match = _STEP.match(path)
        if match is None or not path.endswith("/MANIFEST.json"):
            continue
        try:
            manifest = json.loads(entry.content)
        except ValueError:
            continue
        folder = path[: -len("MANIFEST.json")]
        if all((f := files.get(folder + name)) is not None and f.sha256 == want["sha256"] and f.size == want["size"]
               for name, want in manifest["files"].items()):
            steps.add(int(match.group(1)))
    return steps


def _only_the_watch_mark(before: dict, after: dict) -> bool:
    """A watcher's commit of its mark beside the lease (`hub/leasewatch.py`), which changes nothing of the run."""
    from colab_kit.hub.leasewatch import WATCH_MARK

    def content(entry):
        return getattr(entry, "content", entry)

    changed = {p for p in set(before) | set(after) if content(before.get(p)) != content(after.get(p))}
    return bool(changed) and all(p.rsplit("/", 1)[-1] == WATCH_MARK for p in changed)
