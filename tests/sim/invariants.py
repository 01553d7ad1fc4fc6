"""What must hold after every event of a schedule, judged against the cloud as it is (never the kit's word):

  I1  once a checkpoint was complete in the cloud, one always is;
  I2  no "in the cloud" claim (a `cloud` event, the newest the holder's tracker reports) is false then
      (the holder: the runtime whose lease is in the cloud);
  I3  a runtime changes nothing in the run folder once its own mount shows another runtime's lease (or
      once it said it lost it); a runtime writing lease.json to take it is the one exception;
  I4  a resume picks the newest checkpoint complete in the cloud (or a newer one), never an older one,
      and never a fresh start over one; stopping to say it cannot is allowed (doubt costs time);
  I5  nothing is deleted, truncated or overwritten that the cloud holds whole unless a newer one is whole
      there too, and only by the runtime whose lease is in the cloud (where nothing confirms uploads: unless
      another one is whole there, by a runtime whose mount shows its lease);
  I6  a runtime that lives and beats is never taken over unasked: no takeover without takeover=True while the
      holder runs and its heartbeat reached the cloud less than a heartbeat interval before;
and once the faults healed and the runtime holding the run had the time its uploads need (`World._wind_down`):
  I7  what it saved last is whole in the cloud, or one further along is (a save is never lost on the way);
  I8  retention made progress: the folder holds no more checkpoints than the rules keep (`keep` where uploads
      are confirmed, the ladder where nothing is), plus what is newer than the newest whole one.
"""

from __future__ import annotations

import json
import re

from colab_kit.drive.retention import ladder

__all__ = ["Invariants"]

_STEP = re.compile(r"/checkpoints/checkpoint-(\d+)(?:/|$)")
_DESTRUCTIVE = {"unlink", "truncate", "rmdir", "rmtree", "rename", "api_delete"}


class Invariants:
    def __init__(self, world):
        self.w = world
        self.violations: list[str] = []
        self.ever = False
        self._version = -1
        self._complete: set[int] = set()
        self._root = str(world_run_dir(world)) + "/checkpoints/checkpoint-"
        self._lease_path = str(world_run_dir(world)) + "/lease.json"
        self._parsed: tuple[bytes | None, tuple | None] = (None, None)

    # -- ground truth ---------------------------------------------------------------------------------
    def complete_steps(self) -> set[int]:
        drive = self.w.drive
        if drive.version != self._version:
            self._version = drive.version
            self._complete = {int(p[len(self._root):]) for p in drive.dirs
                              if p.startswith(self._root) and p[len(self._root):].isdigit() and drive.complete(p)}
        return self._complete

    def _view_lease(self, rt):
        """(session, released) of lease.json as `rt`'s mount shows it; None: none, or unreadable."""
        path = self._lease_path
        blob = rt.vm.dirty.get(path) if rt is not None and rt.vm is not None else None
        data = blob.data if blob is not None else (self.w.drive.files[path].data if path in self.w.drive.files else None)
        if data is None:
            return None
        if self._parsed[0] is data:
            return self._parsed[1]
        try:
            lease = json.loads(data)
            parsed = lease["session"], bool(lease.get("released"))
        except (ValueError, KeyError, TypeError):
            parsed = None
        self._parsed = (data, parsed)
        return parsed

    def holds(self, rt, *, cloud: bool = True) -> bool:
        """Does `rt` hold the lease: in the cloud (what every runtime will see), or as its own mount shows?"""
        lease = self._view_lease(None if cloud else rt)
        return lease is not None and lease[0] == rt.session and not lease[1]

    def violate(self, code: str, text: str) -> None:
        if not self.violations:
            self.w.note(f"VIOLATION {code}: {text}")
        self.violations.append(f"{code}: {text}")

    # -- checks ---------------------------------------------------------------------------------------
    def after_event(self) -> None:
        steps = self.complete_steps()
        if steps:
            self.ever = True
        elif self.ever:
            self.violate("I1", "no checkpoint is complete in the cloud any more")
        for rt in self.w.live():
            if rt.run is None or not self.holds(rt):
                continue
            newest = rt.run.mirror.tracker.newest_in_cloud()
            if newest is not None and newest.step not in steps:
                self.violate("I2", f"{rt} says checkpoint-{newest.step} is in the cloud; it is not whole there")

    def at_end(self) -> None:
        self.after_event()

    def check_claim(self, rt, step: int) -> None:
        if step not in self.complete_steps():
            self.violate("I2", f"{rt} journals checkpoint-{step} in the cloud; it is not whole there")

    @property
    def lease_path(self) -> str:
        return self._lease_path

    def check_takeover(self, rt, previous, *, asked: bool) -> None:
        if asked or previous is None:
            return
        holder = next((other for other in self.w.runtimes if other.session == previous.session), None)
        if holder is None or not holder.alive or holder.run is None:
            return
        landed = self.w.lease_landed.get(previous.session)
        if landed is not None and landed > self.w.clock.t - previous.heartbeat_s:
            self.violate("I6", f"{rt} took the run over from {holder}, which runs and whose heartbeat reached the "
                               f"cloud {self.w.clock.t - landed:.0f} s ago (one every {previous.heartbeat_s:.0f} s)")

    def settled(self, rt) -> list[tuple[str, str]]:
        """What breaks I7 and I8 for `rt`, the runtime holding the run, now: [(code, text)]."""
        complete = self.complete_steps()
        # A checkpoint further along (another timeline's, which reached the cloud after this runtime started
        # behind it) supersedes its last save, as a resume would: steps are compared, whatever the timeline.
        if rt.saved is not None and rt.saved not in complete and not any(step > rt.saved for step in complete):
            return [("I7", f"{rt} saved checkpoint-{rt.saved} last, and with every fault healed it is not whole in the "
                           f"cloud (whole there: {sorted(complete)})")]
        drive, root = self.w.drive, self._root
        folders = {int(p[len(root):]) for p in drive.dirs if p.startswith(root) and p[len(root):].isdigit()}
        # What is newer than anything it saved may be another runtime's upload on its way: not counted.
        mine = rt.saved if rt.saved is not None else rt.resumed
        above = {f for f in folders if mine is None or f > mine}
        if rt.run.mirror.pruner.kind == "unconfirmed":
            written = {f: drive.files[f"{root}{f}/MANIFEST.json"].mtime_ns / 1e9 for f in folders
                       if f"{root}{f}/MANIFEST.json" in drive.files}
            now = self.w.clock.EPOCH + self.w.clock.t + self.w.offsets.get(rt.vm.name, 0.0)
            bound, rule = len(ladder(written, now, self.w.s.settle_s)) + 3, "the ladder"
        else:
            bound, rule = rt.run.mirror.keep + 1, f"keep={rt.run.mirror.keep}"
        if len(folders) > bound + len(above):
            return [("I8", f"{len(folders)} checkpoints are left ({sorted(folders)}); {rule} keeps {bound}, and "
                           f"{len(above)} are newer than any it saved")]
        return []

    def truth_at_start(self, rt) -> set[int]:
        return set(self.complete_steps())

    def check_resume(self, rt, found, truth: set[int]) -> None:
        newest = max(truth, default=None)
        if newest is None:
            return
        if found is None:
            self.violate("I4", f"{rt} starts fresh, but checkpoint-{newest} is complete in the cloud")
        elif found.step < newest:
            self.violate("I4", f"{rt} resumes from checkpoint-{found.step}, but checkpoint-{newest} is complete "
                               f"in the cloud")

    def before_change(self, op: str, path: str, data: bytes | None = None) -> None:
        rt = self.w.fs.actor
        if rt is None or rt.acquiring and path.endswith("/lease.json"):
            return
        lease = self._view_lease(rt)
        if lease is not None and lease[0] != rt.session and not lease[1]:
            self.violate("I3", f"{rt} {op} {_short(path)} while its mount shows lease {lease[0]}'s")
        elif rt.run is not None and (rt.run.mirror.paused or rt.run.lease.lost):
            self.violate("I3", f"{rt} {op} {_short(path)} after it knew its lease was lost")
        match = _STEP.search(path)
        if match is None and not (op in _DESTRUCTIVE and path.endswith("/checkpoints")):
            return
        complete = self.complete_steps()
        if match is None:  # the whole checkpoints folder moved or removed
            doomed = set(complete)
        else:
            doomed = {int(match.group(1))} & complete
            if op not in _DESTRUCTIVE:  # a write: destructive only over other bytes that the cloud holds
                there = self.w.drive.files.get(path)
                if there is None or there.data == data:
                    return
        if not doomed:
            return
        confirmed = rt.run is not None and rt.run.mirror.pruner.kind != "unconfirmed"
        if not self.holds(rt, cloud=confirmed):  # where nothing confirms an upload, its own mount's word
            self.violate("I5", f"{rt} {op} {_short(path)} without holding the lease")
            return
        others = complete - doomed
        if confirmed and not any(s > max(doomed) for s in others) or not others:
            self.violate("I5", f"{rt} {op} {_short(path)} (whole in the cloud) while the cloud holds "
                               f"{sorted(others) or 'no other'} whole" + (" and none newer" if confirmed else ""))


def world_run_dir(world):
    from world import RUN_DIR

    return RUN_DIR


def _short(path: str) -> str:
    return path.split("/sim/drive/run/")[-1]
