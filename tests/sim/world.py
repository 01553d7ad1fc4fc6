"""The simulator's world: a virtual clock, an event queue, and the runtimes that run the kit's own code.

Each runtime is one notebook kernel on one VM. It opens the run folder as `start_run` does (the kit's
`Lease.acquire` and `start.open_claimed`, with its workers not threaded), then the world calls the
workers' step functions (`Mirror.step`, `Lease.step`) when they ask, a little late at random, and saves
a checkpoint every save interval as the Trainer would (files on local disk, `take_snapshot`,
`Mirror.submit`), sometimes twice at one step (the Trainer's epoch-end save rewriting the files in place).
Disconnects kill a VM (its Drive cache and queue die with it; one may come while the run's first checkpoint
uploads), kernel restarts keep the VM, a second runtime may take over while the first still runs, a fresh
mount may show nothing for its first seconds, and each VM's clock may be minutes off, or set back. The
invariants (`invariants.py`) are checked after every event and before every change to the Drive folder; at
the end the faults heal, the runtime holding the run gets time to finish its uploads and pruning, and what it
saved last must be in the cloud, within the bounds retention keeps.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import json
import random
from pathlib import Path

from colab_kit.checkpoints.clock import Clock
from colab_kit.checkpoints import storage, validity
from colab_kit.distributed.ranks import Ranks
from colab_kit.drive.driveapi import DriveApi
from colab_kit.drive.lease import Lease
from colab_kit.drive.retention import Ladder
from colab_kit.errors import DriveError, LeaseHeldError
from colab_kit.run.start import open_claimed
from colab_kit.runtime import RuntimeInfo

from api import FakeDriveService
from ending import WindDown
from faults import Faults
from invariants import Invariants
from memfs import DRIVE, LocalDisk, MemFs
from model import DriveModel
from saves import OUT, TrainerSaves
from schedule import Schedule

__all__ = ["World", "VirtualClock", "RUN_DIR"]

RUN_DIR = Path(DRIVE) / "run"
_RUNTIME = RuntimeInfo(colab=False, notebook=True, gpu=None, ram_limit_bytes=12 << 30)


class VirtualClock(Clock):
    """Time that moves only when the world says so; `sleep` lets the other runtimes' events run."""

    EPOCH = 1.8e9

    def __init__(self, world):
        self.world, self.t = world, 0.0

    def time(self) -> float:
        return self.EPOCH + self.t + self.world.clock_offset()  # the acting VM's clock, which may be off

    def monotonic(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            self.world.sleep(seconds)

    def within(self, seconds, fn, name: str = ""):
        return fn()  # no threads here: the call is the caller's, and time only moves in the world

    def advance(self, seconds: float) -> None:
        self.t += seconds


class Runtime:
    """One kernel on one VM."""

    def __init__(self, world, vm, disk: LocalDisk):
        self.number = next(world.numbers)
        self.saved: int | None = None  # the step of its newest save
        self.resave: int | None = None  # a step the Trainer saves again (at the epoch's end) as its upload begins
        self.resumed: int | None = None  # the step it resumed from
        self.name = f"rt{self.number}"
        self.world, self.vm, self.disk = world, vm, disk
        self.pid = 1000 + self.number
        self.session = f"s{self.number}"
        self.run = None
        self.alive = True
        self.acquiring = False
        self.step = 0
        self.busy = False
        self.exported: dict | None = None  # its last export of final/ (the Hub world's): name -> sha256
        self.exports = 0
        self.uploading = False  # its data on the way to the cloud (the Hub's LFS uploads take time): meanwhile
        #                         its heartbeat, a thread of its own, goes on (`World.sleep`)

    def __repr__(self) -> str:
        return self.name


class World(TrainerSaves, WindDown):
    """One schedule, run to its end: `run()` returns the violations found (empty: none)."""

    def __init__(self, schedule: Schedule, *, trace_lines: int = 60):
        self.s = schedule
        self.rng = random.Random(schedule.seed)
        self.clock = VirtualClock(self)
        self.trace = collections.deque(maxlen=trace_lines)
        self.drive = DriveModel(DRIVE, rate=schedule.rate, rng=self.rng, quota=schedule.quota)
        self.faults = Faults(schedule.faults, self.rng, self.clock)
        self.fs = MemFs(self.drive, self.clock, self.faults, attrs=schedule.attrs, fstype=schedule.fstype)
        self.service = FakeDriveService(self.drive, self.rng, fail=schedule.api_fail, fail_page=schedule.api_fail)
        self.service.clock = self.clock
        self.invariants = Invariants(self)
        self.fs.on_change = self._changing
        self.service.on_delete = lambda path: self.invariants.before_change("api_delete", path)
        self.drive.on_commit = self._committed
        self.offsets: dict[str, float] = {}  # each VM's clock: seconds off true time
        self.lease_landed: dict[str, float] = {}  # session -> when its lease.json last reached the cloud
        self.ending = self._recycled = False
        self.happened: collections.Counter = collections.Counter()  # the fault kinds met (for the totals)
        self.runtimes: list[Runtime] = []
        self.live_pids: dict[int, float] = {}
        self._events: list = []
        self._seq = itertools.count()
        self.numbers = itertools.count(1)
        self.starts = self.resumes = self.refusals = 0

    # -- events ---------------------------------------------------------------------------------------
    def at(self, t: float, kind: str, rt: Runtime | None = None, payload=None) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, rt, payload))

    def note(self, text: str) -> None:
        self.trace.append(f"{self.clock.t:9.1f} {text}")

    def run(self) -> list[str]:
        s = self.s
        vm = self.new_vm()
        self.at(0.0, "start", None, (vm, LocalDisk(), False))
        for t in s.disconnects:
            self.at(t, "disconnect")
        for t in s.restarts:
            self.at(t, "restart")
        for t, forced in s.takeovers:
            self.at(t, "second", None, forced)
        for t, seconds in s.hides:
            self.at(t, "hide", None, seconds)
        for t, seconds in s.outages:
            self.at(t, "enotconn", None, seconds)
        for t, seconds in s.api_outages:
            self.at(t, "api_down", None, seconds)
        for t, seconds in s.clock_steps:
            self.at(t, "clock_step", None, seconds)
        with storage.use_filesystem(self.fs), _clock_in_use(self.clock):
            validity.clear()
            while self._events and not self.invariants.violations:
                t, _, kind, rt, payload = heapq.heappop(self._events)
                if t > s.duration:
                    self.at(t, kind, rt, payload)
                    break
                if rt is not None and (not rt.alive or rt.busy):
                    if rt.alive:  # its own step is under way (it sleeps): this one comes after
                        self.at(self.clock.t + 1.0, kind, rt, payload)
                    continue
                self.clock.t = max(self.clock.t, t)
                self.drive.advance(self.clock.t)  # Drive's uploads up to now, before anything happens
                self._do(kind, rt, payload)
                self.invariants.after_event()
            if not self.invariants.violations:
                self._wind_down()
            self.invariants.at_end()
        return self.invariants.violations

    # -- clocks and the cloud's own record -------------------------------------------------------------
    def new_vm(self):
        vm = self.drive.new_vm(f"vm{len(self.drive.vms) + 1}", self.clock.t)
        self.offsets[vm.name] = self.rng.uniform(-self.s.skew_s, self.s.skew_s) if self.s.skew_s else 0.0
        self.happened["skewed clocks"] += bool(self.offsets[vm.name])
        return vm

    def clock_offset(self) -> float:
        vm = self.fs.vm
        return self.offsets.get(vm.name, 0.0) if vm is not None else 0.0

    def _committed(self, path: str, data: bytes) -> None:
        if path == self.invariants.lease_path:
            try:
                self.lease_landed[json.loads(data)["session"]] = self.clock.t
            except (ValueError, KeyError, TypeError):
                pass

    def _on_clock_step(self, seconds) -> None:
        rt = self._victim()
        if rt is not None:
            self.offsets[rt.vm.name] -= seconds
            self.happened["clocks set back"] += 1
            self.note(f"fault: {rt.vm.name}'s clock is set back {seconds:.0f} s")

    def sleep(self, seconds: float) -> None:
        """A runtime waits: the other runtimes' events due meanwhile run, then time is where it asked."""
        until = self.clock.t + seconds
        while self._events and self._events[0][0] <= until and not self.invariants.violations:
            t, _, kind, rt, payload = heapq.heappop(self._events)
            if kind == "beat" and rt is not None and rt.alive and rt.busy and self._beats_meanwhile(rt):
                self.clock.t = max(self.clock.t, t)
                self._do(kind, rt, payload)  # the lease's thread, beside the upload that keeps its runtime busy
                continue
            if rt is not None and (not rt.alive or rt.busy):
                if rt.alive:
                    self.at(until + 0.5, kind, rt, payload)
                continue
            if kind in ("start", "second", "disconnect", "restart"):  # the world's own: after this wait
                self.at(until + 0.5, kind, rt, payload)
                continue
            self.clock.t = max(self.clock.t, t)
            self.drive.advance(self.clock.t)
            self._do(kind, rt, payload)
        self.clock.t = max(self.clock.t, until)

    @staticmethod
    def _beats_meanwhile(rt: Runtime) -> bool:
        """Does `rt`'s heartbeat go on while it is busy? Only while its data uploads outside the lease's lock
        (a real thread would wait for a held lock: here that wait is the beat coming later)."""
        lock = getattr(getattr(getattr(rt.run, "lease", None), "_lock", None), "locked", None)
        return rt.run is not None and not (lock is not None and lock())

    def _do(self, kind: str, rt: Runtime | None, payload) -> None:
        handler = getattr(self, "_on_" + kind)
        if rt is None:
            handler(payload)
            return
        previous = (self.fs.vm, self.fs.disk, self.fs.actor)
        self.fs.vm, self.fs.disk, self.fs.actor = rt.vm, rt.disk, rt
        was_busy, rt.busy = rt.busy, True
        try:
            handler(rt, payload)
        finally:
            rt.busy = was_busy
            self.fs.vm, self.fs.disk, self.fs.actor = previous

    # -- the runtimes' lives ------------------------------------------------------------------------------
    def live(self) -> list[Runtime]:
        return [rt for rt in self.runtimes if rt.alive]

    def process_start(self, pid: int):
        return self.live_pids.get(pid)

    def _on_start(self, payload) -> None:
        vm, disk, takeover = payload
        rt = Runtime(self, vm, disk)
        self.runtimes.append(rt)
        self.live_pids[rt.pid] = self.clock.time()
        self.at(self.clock.t, "open", rt, takeover)

    def _on_open(self, rt: Runtime, takeover) -> None:
        s = self.s
        self.starts += 1
        if self.rng.random() < s.hide_at_open:  # a fresh mount is busy: a checkpoint hidden for a moment
            self._on_hide(self.rng.uniform(0.3, 4.0), under="/checkpoints/checkpoint-")
        if self.rng.random() < s.busy_at_open:  # or it shows no checkpoints and no journal at all for a moment
            seconds = self.rng.uniform(0.5, 4.5)
            for path in (RUN_DIR / "checkpoints", RUN_DIR / "events.jsonl"):
                self.faults.hide(str(path), seconds)
            self.note(f"fault: the fresh mount shows no checkpoints and no journal for {seconds:.1f} s")
            self.happened["busy fresh mounts"] += 1
        lease = Lease(RUN_DIR, heartbeat_s=s.heartbeat_s, host=rt.vm.name, pid=rt.pid,
                      process_start=self.process_start, session=rt.session)
        rt.acquiring = True
        try:
            storage.make_dirs(OUT)
            storage.make_dirs(RUN_DIR / "checkpoints")
            previous = lease.acquire(takeover=bool(takeover), run_name="run")
        except (LeaseHeldError, DriveError, OSError) as exc:
            self._refused(rt, exc)
            return
        finally:
            rt.acquiring = False
        self.invariants.check_takeover(rt, previous, asked=bool(takeover))
        truth = self.invariants.truth_at_start(rt)
        try:
            run, found, _ = open_claimed(
                "run", RUN_DIR, OUT, lease=lease, runtime=_RUNTIME, on_drive=False, confirm=self._confirm(),
                resume=True, keep=s.keep, save_every_s=None, save_every_steps=10, gauges=False,
                ladder=Ladder(s.settle_s), pace_bps=s.pace_bps, ranks=Ranks(), threaded=False)
        except (DriveError, LeaseHeldError) as exc:  # stopped and said so: doubt costs time
            self.refusals += 1
            self.note(f"{rt} stopped: {str(exc)[:100]}")
            self.at(self.clock.t + s.retry_s, "open", rt, False)
            return
        self._opened(rt, run, found, truth)

    def _refused(self, rt: Runtime, exc: BaseException) -> None:
        """`rt` could not claim the run: said, then it tries again later, unless another runtime runs the run
        (the user reads the message and leaves it)."""
        self.refusals += 1
        self.note(f"{rt} refused: {type(exc).__name__}: {str(exc)[:90]}")
        if any(other.run is not None for other in self.live() if other is not rt):
            self._end(rt)
        else:
            self.at(self.clock.t + self.s.retry_s, "open", rt, False)

    def _opened(self, rt: Runtime, run, found, truth: set[int]) -> None:
        """`rt` opened the run (`open_claimed` returned): its resume judged, then its workers and saves begin."""
        s = self.s
        self.invariants.check_resume(rt, found, truth)
        self.resumes += found is not None
        rt.run = run
        rt.step = found.step if found is not None else 0
        rt.resumed = found.step if found is not None else None
        self._watch_journal(rt)
        self.note(f"{rt} on {rt.vm.name} resumes from {found.step if found else 'nothing'} ({run.durability})")
        self.at(self.clock.t, "mirror", rt)
        self.at(self.clock.t + s.heartbeat_s, "beat", rt)
        self.at(self.clock.t + s.interval_s * (0.5 + self.rng.random()), "save", rt)

    def _confirm(self):
        if not self.s.api:
            return "auto"
        api = DriveApi(endpoint="http://sim.invalid", root=DRIVE)
        api._service = self.service
        return api

    def _watch_journal(self, rt: Runtime) -> None:
        journal, write = rt.run.journal, rt.run.journal.write

        def watched(event, **fields):
            if event in ("cloud", "prune", "kept", "sync", "resume", "archive", "warn"):
                self.note(f"{rt} {event} " + " ".join(f"{k}={v}" for k, v in fields.items() if k in (
                    "step", "steps", "what", "reason", "witness", "path", "label"))[:160])
            if event == "cloud" and "step" in fields:
                self.invariants.check_claim(rt, fields["step"])
            if event == "sync" and self.s.recycle_first and not self._recycled:  # while the first one uploads
                self._recycled = True
                upload_s = self.s.size * 4 / 3 / self.s.rate
                self.at(self.clock.t + self.rng.uniform(2.0, max(2.5, 0.9 * upload_s)), "recycle", rt)
            return write(event, **fields)

        journal.write = watched

    def _on_mirror(self, rt: Runtime, _) -> None:
        wait = rt.run.mirror.step()
        if rt.run.mirror.paused:
            return
        gap = max(wait, self.s.min_gap_s) * (1.0 + self.rng.random())
        self.at(self.clock.t + gap, "mirror", rt)

    def _on_beat(self, rt: Runtime, _) -> None:
        if rt.run.lease.step(rt.run._lease_lost):
            self.at(self.clock.t + self.s.heartbeat_s * (1.0 + 0.2 * self.rng.random()), "beat", rt)

    def _victim(self) -> Runtime | None:
        live = [rt for rt in self.live() if rt.run is not None]
        return self.rng.choice(live) if live else None

    def _on_disconnect(self, _, rt: Runtime | None = None) -> None:
        rt = rt or self._victim()
        if rt is None:
            return
        self._end(rt)
        self.drive.kill(rt.vm)
        self.note(f"{rt} disconnected: {rt.vm.name} is gone")
        if not self.live():
            self.at(self.clock.t + self.rng.uniform(30, 300), "start", None, (self.new_vm(), LocalDisk(), False))

    def _on_recycle(self, rt: Runtime, _) -> None:
        """Colab recycles the runtime while the run's first checkpoint uploads: its manifest (a small file) has
        reached the cloud, its model file has not."""
        self.happened["first uploads recycled"] += 1
        self._on_disconnect(None, rt)

    def _on_restart(self, _) -> None:
        rt = self._victim()
        if rt is None:
            return
        self._end(rt)
        self.note(f"{rt} kernel restarted on {rt.vm.name}")
        self.at(self.clock.t + self.rng.uniform(5, 60), "start", None, (rt.vm, rt.disk, False))

    def _on_second(self, forced) -> None:
        vm = self.new_vm()
        self.note(f"a second runtime on {vm.name}" + (" takes over" if forced else ""))
        self.at(self.clock.t, "start", None, (vm, LocalDisk(), forced))

    def _end(self, rt: Runtime) -> None:
        rt.alive = False
        self.live_pids.pop(rt.pid, None)

    def _on_hide(self, seconds, under: str = "/") -> None:
        paths = [p for p in list(self.drive.files) + list(self.drive.dirs)
                 if p.startswith(str(RUN_DIR) + "/") and under in p[len(str(RUN_DIR)):]]
        if paths:
            path = self.rng.choice(paths)
            self.faults.hide(path, seconds)
            self.note(f"fault: {path[len(DRIVE) + 1:]} hidden for {seconds:.1f} s")

    def _on_enotconn(self, seconds) -> None:
        self.faults.disconnect(seconds)
        self.note(f"fault: the mount answers errno 107 for {seconds:.0f} s")

    def _on_api_down(self, seconds) -> None:
        self.service.down_until = self.clock.t + seconds
        self.note(f"fault: the Drive API answers 503 for {seconds:.0f} s")


class _clock_in_use:
    def __init__(self, clock):
        from colab_kit.checkpoints.clock import use_clock

        self._cm = use_clock(clock)

    def __enter__(self):
        return self._cm.__enter__()

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)
