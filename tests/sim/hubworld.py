"""The simulator's Hub world: the runtimes keep the run on the Hugging Face Hub (`start_run(store="hf://...")`)
instead of a Drive folder, with the kit's own code: `HubRepo` (on the simulated Hub, `simhub.py`), `HubLease`,
`HubStore` and the replica on each VM's local disk, and the same mirror, retention, gate and resume
(`start.open_claimed(hub=...)`, workers not threaded). The same schedules (`schedule.py`: saves, disconnects
that take a VM's disk and replica with it, kernel restarts, second runtimes, clocks off or set back, saves of a
step twice), with the Hub's own faults (5xx and 429s, timeouts, commit answers lost after the commit landed,
listings that miss a file, outages), and the same invariants judged on the Hub's head (`hub_invariants.py`).

Issue 46 added the Hub's own fault kinds: LFS uploads longer than a lease's watch window (the runtime busy with
them, its heartbeat going on beside: `World.sleep`), spells of 429s for every commit longer than that window, and
second runtimes that ask for the run while the first one works, and exports of final/ made again. A VM's replica
fills as a real one does: what the resume needs at the start, the older checkpoints and final/ at a later event.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
from pathlib import Path

from colab_kit.checkpoints import storage
from colab_kit.distributed.ranks import Ranks
from colab_kit.drive.retention import Ladder
from colab_kit.errors import DriveError, LeaseHeldError
from colab_kit.hub.address import HubAddress
from colab_kit.hub.lease import HubLease
from colab_kit.hub.repo import HubRepo
from colab_kit.hub.store import HubStore
from colab_kit.hub.leasewatch import WATCH_BEATS
from colab_kit.checkpoints.journal import EVENTS
from colab_kit.checkpoints.manifest import MANIFEST, parse_manifest
from colab_kit.run.start import open_claimed

from hub_invariants import HubInvariants
from memfs import LOCAL
from saves import OUT, _payload
from simhub import HubFaultRates, SimHub
from world import _RUNTIME, World

__all__ = ["HubWorld", "HubInvariants"]  # the invariants: hub_invariants.py

ADDRESS = HubAddress.parse("hf://user/runs")
REPLICA = Path(LOCAL) / "run.hub"


class HubWorld(World):
    """`World` with the run kept on the (simulated) Hub."""

    def __init__(self, schedule, **kwargs):
        super().__init__(schedule, **kwargs)
        rng = self.rng  # the schedule's draws above replay as in the Drive world; the Hub's faults come after
        rates = HubFaultRates(fail=rng.choice((0.0, 0.02, 0.06)), lost=rng.choice((0.0, 0.05, 0.15)),
                              hide=rng.choice((0.0, 0.03)))
        self.hub = SimHub(self, rates, Path(LOCAL) / "hf-cache")
        self.hub_outages: list[tuple[float, float]] = []
        self._lease_seen = None
        self.invariants = HubInvariants(self)
        self.hub.on_commit = self.invariants.before_commit
        self.hub.after_commit = self._hub_committed
        self._draw_issue_46_faults(rng)

    def _draw_issue_46_faults(self, rng) -> None:
        """Issue 46's Hub fault kinds, drawn after the others (the draws above replay the schedules of before):
        LFS uploads slower than a lease's watch window, spells of 429s for commits longer than it, and a
        second runtime that asks for the run (unforced) while the first one works."""
        s, window = self.s, WATCH_BEATS * self.s.heartbeat_s
        if rng.random() < 0.4:  # a checkpoint's upload takes 0.3 to 3 watch windows
            self.hub.upload_bps = s.size * 4 / 3 / (window * rng.uniform(0.3, 3.0))
        spells = sorted(rng.uniform(0.05, 0.95) * s.duration for _ in range(rng.choice((0, 0, 1, 2))))
        self.hub.limited = [(t, t + window * rng.uniform(0.3, 4.0)) for t in spells]
        seconds = sorted(rng.uniform(0.1, 0.95) * s.duration for _ in range(rng.choice((0, 1, 1, 2))))
        # A second runtime that comes as a spell begins: its watch sees a holder whose heartbeat stands still.
        self._seconds = sorted(seconds + [a + window * rng.uniform(0.0, 0.3) for a, _ in self.hub.limited
                                          if rng.random() < 0.6])
        self.export_share = rng.choice((0.0, 0.5, 1.0))  # how often a runtime exports final/ (and again)
        if self.hub.upload_bps or self.hub.limited:
            self.note(f"the Hub: uploads at {self.hub.upload_bps or 0:.0f} B/s, commits refused (429) in "
                      f"{[(round(a), round(b)) for a, b in self.hub.limited]}, second runtimes at "
                      f"{[round(t) for t in self._seconds]}")

    def run(self) -> list[str]:
        for t in self._seconds:
            self.at(t, "second", None, False)
        return super().run()

    def _opened(self, rt, run, found, truth) -> None:
        super()._opened(rt, run, found, truth)
        if self.rng.random() < self.export_share:
            self.at(self.clock.t + self.s.interval_s * self.rng.uniform(0.5, 3.0), "export", rt)

    def _on_export(self, rt, _) -> None:
        """The holder exports the model to final/ (`run.save_final`), now and then again: a new model, or the
        same one again ("Run all" after training ended)."""
        if self.ending or rt.run is None:
            return
        if rt.exported is None or self.rng.random() < 0.7:
            rt.exports += 1
        shape = random.Random(f"{rt.session}-{rt.exports}").random()  # the same model again: the same files
        model = _Model(f"{rt.session}-{rt.exports}", self.s.size, shards=1 + (shape < 0.5))
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # an export's files differ: shards, metrics or none
                target = rt.run.save_final(model, metrics={"exports": rt.exports} if shape < 0.3 or shape > 0.7 else None)
            manifest = parse_manifest(storage.read_bytes(target / MANIFEST))
            rt.exported = {name: entry.sha256 for name, entry in manifest.files.items()}
            self.happened["exports of final/"] += 1
        except (DriveError, OSError) as exc:
            self.note(f"{rt} export failed: {type(exc).__name__}: {str(exc)[:80]}")
        self.at(self.clock.t + self.s.interval_s * self.rng.uniform(0.5, 3.0), "export", rt)

    def _on_beat(self, rt, _) -> None:
        """The Hub lease's thread: it looks every quarter heartbeat (30 s at most) and commits when one is due, a
        refused beat tried again at the next look (`HubLease.start_heartbeat`)."""
        if rt.run.lease.step(rt.run._lease_lost):
            self.at(self.clock.t + min(30.0, self.s.heartbeat_s / 4) * (1.0 + 0.2 * self.rng.random()), "beat", rt)

    def _hub_committed(self, files: dict) -> None:
        """A commit landed: a lease renewed by it (a beat, or a commit of the holder's that carries the lease) is
        the holder's sign of life; another runtime's commit beside an unchanged lease (a watcher's mark) is not."""
        entry = files.get("run/lease.json")
        if entry is not None and entry.content != self._lease_seen:
            self._lease_seen = entry.content
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
        rt.owed = _journal_lines(REPLICA / EVENTS)  # a kernel restart's replica: lines the Hub may not have yet
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
        if store.fill.later:  # the older checkpoints and final/ arrive behind the resume (the thread's work)
            self.at(self.clock.t + self.s.interval_s / 2, "fill", rt, store)

    def _on_fill(self, rt, store) -> None:
        """The replica's filling (`hub/fill.py`), in a real run a thread: the older checkpoints and final/, each
        folder whole; the Hub not answering, it tries again later."""
        if self.ending or rt.run is None:
            return
        if store.fill.fill():
            rt.run.mirror.adopt_existing()
        else:
            self.at(self.clock.t + self.s.retry_s, "fill", rt, store)

    # The Drive world's faults, as the Hub has them.
    def _on_hide(self, seconds, under: str = "/") -> None:
        self.hub.hidden_until = self.clock.t + seconds
        self.note(f"fault: the Hub's listings miss a checkpoint file for {seconds:.1f} s")

    def _on_enotconn(self, seconds) -> None:
        self.hub.down_until = self.clock.t + seconds
        self.hub_outages.append((self.clock.t, self.hub.down_until))
        self.happened["hub outages"] += 1
        self.note(f"fault: the Hub does not answer for {seconds:.0f} s")

    def _on_api_down(self, seconds) -> None:
        self.hub.downloads_down_until = self.clock.t + seconds
        self.happened["hub download outages"] += 1
        self.note(f"fault: the Hub's downloads fail for {seconds:.0f} s (its API answers)")

    def _wind_down(self) -> None:
        self.hub.rates, self.hub.limited = HubFaultRates(), []
        self.hub.down_until = self.hub.hidden_until = self.hub.downloads_down_until = -1.0
        super()._wind_down()


class _Model:
    """What `run.save_final` needs of a model: `save_pretrained`, here onto the VM's disk (the storage seam)."""

    def __init__(self, key: str, size: int, shards: int = 1):
        self.key, self.size, self.shards = key, size, shards

    def save_pretrained(self, folder, safe_serialization=True) -> None:
        storage.make_dirs(folder)
        names = ["model.safetensors"] if self.shards == 1 else \
            [f"model-{i:05d}-of-{self.shards:05d}.safetensors" for i in range(1, self.shards + 1)]
        for name in names:
            storage.atomic_write_bytes(Path(folder) / name, _payload(self.key + name, self.size // len(names)),
                                       durable=False)


def _journal_lines(path: Path) -> set[bytes]:
    try:
        return {line for line in storage.read_bytes(path).splitlines() if line.strip()}
    except OSError:
        return set()
