"""The simulator's Hub world: the runtimes keep the run on the Hugging Face Hub (`start_run(store="hf://...")`)
instead of a Drive folder, with the kit's own code: `HubRepo` (on the simulated Hub, `simhub.py`), `HubLease`,
`HubStore` and the replica on each VM's local disk, and the same mirror, retention, gate and resume
(`start.open_claimed(hub=...)`, workers not threaded). The same schedules (`schedule.py`: saves, disconnects
that take a VM's disk and replica with it, kernel restarts, second runtimes, clocks off or set back, saves of a
step twice), with the Hub's own faults (5xx and 429s, timeouts, commit answers lost after the commit landed,
listings that miss a file, outages), and the same invariants judged on the Hub's head (`HubInvariants`):

  I1  once a checkpoint was whole on the Hub, one always is;
  I2  no `cloud` claim is false when made (the head shows every file with the manifest's sha256);
  I3  no commit lands that carries a lease other than the one at its parent's head, unless it is a claim (the
      fencing: a runtime taken over never lands a commit), nor one of a runtime not holding the lease, but for a
      watcher's mark beside the lease (`hub/leasewatch.py`);
  I4  a resume picks the newest checkpoint whole on the Hub (or newer), never an older one or a fresh start;
  I5  no commit deletes a checkpoint whole on the Hub unless a newer one is whole there and stays;
  I6  a runtime that runs and beats is never taken over unasked;
  I7, I8 at the end: what the holder saved last is whole on the Hub, and no more checkpoints are left than keep.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from colab_kit.checkpoints import storage
from colab_kit.distributed.ranks import Ranks
from colab_kit.drive.retention import Ladder
from colab_kit.errors import DriveError, LeaseHeldError
from colab_kit.hub.address import HubAddress
from colab_kit.hub.lease import HubLease
from colab_kit.hub.repo import HubRepo
from colab_kit.hub.store import HubStore
from colab_kit.run.start import open_claimed

from invariants import Invariants
from memfs import LOCAL
from saves import OUT
from simhub import HubFaultRates, SimHub
from world import _RUNTIME, World

__all__ = ["HubWorld", "HubInvariants"]

ADDRESS = HubAddress.parse("hf://user/runs")
REPLICA = Path(LOCAL) / "run.hub"
_STEP = re.compile(r"^run/checkpoints/checkpoint-(\d+)/")


class HubWorld(World):
    """`World` with the run kept on the (simulated) Hub."""

    def __init__(self, schedule, **kwargs):
        super().__init__(schedule, **kwargs)
        rng = self.rng  # the schedule's draws above replay as in the Drive world; the Hub's faults come after
        rates = HubFaultRates(fail=rng.choice((0.0, 0.02, 0.06)), lost=rng.choice((0.0, 0.05, 0.15)),
                              hide=rng.choice((0.0, 0.03)))
        self.hub = SimHub(self, rates, Path(LOCAL) / "hf-cache")
        self.invariants = HubInvariants(self)
        self.hub.on_commit = self.invariants.before_commit
        self.hub.after_commit = self._hub_committed

    def _hub_committed(self, files: dict) -> None:
        entry = files.get("run/lease.json")
        if entry is not None:
            try:
                self.lease_landed[json.loads(entry.content)["session"]] = self.clock.t
            except (ValueError, KeyError, TypeError):
                pass

    def _on_open(self, rt, takeover) -> None:
        s = self.s
        self.starts += 1
        repo = HubRepo(ADDRESS, "hf_sim")
        repo.api = self.hub
        lease = HubLease(repo, "run", heartbeat_s=s.heartbeat_s, host=rt.vm.name, pid=rt.pid,
                         process_start=self.process_start)
        lease.info.session = rt.session
        store = HubStore(repo, lease, REPLICA)
        rt.acquiring, rt.asked = True, bool(takeover)
        try:
            storage.make_dirs(OUT)
            repo.create()
            previous = lease.acquire(takeover=bool(takeover), run_name="run")
        except (LeaseHeldError, DriveError, OSError) as exc:
            self._refused(rt, exc)
            return
        finally:
            rt.acquiring = False
        self.invariants.check_takeover(rt, previous, asked=bool(takeover))
        truth = self.invariants.truth_at_start(rt)
        try:
            storage.make_dirs(REPLICA / "checkpoints")
            store.ensure_lfs_rule()
            store.pull()
            run, found, _ = open_claimed(
                "run", REPLICA, OUT, lease=lease, runtime=_RUNTIME, on_drive=False, confirm="auto", resume=True,
                keep=s.keep, save_every_s=None, save_every_steps=10, gauges=False, ladder=Ladder(s.settle_s),
                pace_bps=s.pace_bps, ranks=Ranks(), threaded=False, hub=store)
        except (DriveError, LeaseHeldError, OSError) as exc:  # stopped and said so: doubt costs time
            lease.release()
            self.refusals += 1
            self.note(f"{rt} stopped: {type(exc).__name__}: {str(exc)[:100]}")
            self.at(self.clock.t + s.retry_s, "open", rt, False)
            return
        self._opened(rt, run, found, truth)

    # The Drive world's faults, as the Hub has them.
    def _on_hide(self, seconds, under: str = "/") -> None:
        self.hub.hidden_until = self.clock.t + seconds
        self.note(f"fault: the Hub's listings miss a checkpoint file for {seconds:.1f} s")

    def _on_enotconn(self, seconds) -> None:
        self.hub.down_until = self.clock.t + seconds
        self.happened["hub outages"] += 1
        self.note(f"fault: the Hub does not answer for {seconds:.0f} s")

    def _on_api_down(self, seconds) -> None:
        self.hub.downloads_down_until = self.clock.t + seconds
        self.happened["hub download outages"] += 1
        self.note(f"fault: the Hub's downloads fail for {seconds:.0f} s (its API answers)")

    def _wind_down(self) -> None:
        self.hub.rates = HubFaultRates()
        self.hub.down_until = self.hub.hidden_until = self.hub.downloads_down_until = -1.0
        super()._wind_down()


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
        was, will = whole_steps(before), whole_steps(after)
        gone = was - will
        if gone and not any(s > max(gone) for s in will):
            self.violate("I5", f"{rt} commits away checkpoint(s) {sorted(gone)} whole on the Hub, leaving "
                               f"{sorted(will) or 'none'} whole")

    def _claimed_from(self, rt, session: str) -> None:
        """I6 at the commit that claims the run: the holder it replaces must not be running and beating, unless
        the claim was asked for (takeover=True). Judged here, not from what the claimer read: a read that failed
        and was taken for "no lease" would hide the holder."""
        holder = next((other for other in self.w.runtimes if other.session == session), None)
        if rt.asked or holder is None or not holder.alive or holder.run is None:
            return
        landed = self.w.lease_landed.get(session)
        beat = self.w.s.heartbeat_s
        if landed is not None and landed > self.w.clock.t - beat:
            self.violate("I6", f"{rt} claims the run from {holder}, which runs and whose lease reached the Hub "
                               f"{self.w.clock.t - landed:.0f} s ago (a commit at least every {beat:.0f} s)")

    def settled(self, rt) -> list[tuple[str, str]]:
        complete = self.complete_steps()
        if rt.saved is not None and rt.saved not in complete and not any(step > rt.saved for step in complete):
            return [("I7", f"{rt} saved checkpoint-{rt.saved} last, and with every fault healed it is not whole on "
                           f"the Hub (whole there: {sorted(complete)})")]
        folders = {int(m.group(1)) for p in self._files() if (m := _STEP.match(p))}
        mine = rt.saved if rt.saved is not None else rt.resumed
        above = {f for f in folders if mine is None or f > mine}
        bound = rt.run.mirror.keep + 1
        if len(folders) > bound + len(above):
            return [("I8", f"{len(folders)} checkpoints are left on the Hub ({sorted(folders)}); keep="
                           f"{rt.run.mirror.keep} keeps {bound}, and {len(above)} are newer than any it saved")]
        return []


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
