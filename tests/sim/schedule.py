"""One seeded schedule: the Drive (mode, upload rate, faults) and what happens to the runtimes (disconnects,
kernel restarts, a second runtime), all drawn from `random.Random(seed)`, so that a seed replays it."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from faults import FaultRates

__all__ = ["MODES", "Schedule", "make_schedule"]

# How the run folder's uploads can be known: DriveFS's attributes; none (a Drive mount without them); a
# mount of another kind without them (rclone); Drive's API over a mount with or without attributes.
MODES = {"attrs": 0.3, "none": 0.2, "other": 0.1, "api": 0.25, "api-none": 0.15}
HOUR = 3600.0


@dataclass
class Schedule:
    seed: int
    mode: str
    duration: float
    interval_s: float  # between saves
    size: int  # bytes of a checkpoint's model file (its optimizer file is a third of it)
    rate: float  # Drive's upload rate, bytes per second
    pace_bps: float  # the rate the kit assumes where nothing confirms uploads (paces writes only)
    keep: int
    settle_s: float
    faults: FaultRates
    hides: list = field(default_factory=list)  # (t, seconds)
    outages: list = field(default_factory=list)  # (t, seconds) of errno 107
    api_outages: list = field(default_factory=list)
    disconnects: list = field(default_factory=list)
    restarts: list = field(default_factory=list)
    takeovers: list = field(default_factory=list)  # (t, forced)
    api_fail: float = 0.0
    hide_at_open: float = 0.0  # the chance that a checkpoint is hidden for a moment as a runtime opens the run
    # Issue 38's fault kinds:
    double_save: float = 0.0  # the chance that a save is followed by a second save of its step (the Trainer's
    #                           epoch-end save beside the kit's), rewriting its files in place
    recycle_first: bool = False  # the VM dies while the run's first checkpoint uploads (its manifest is there)
    busy_at_open: float = 0.0  # the chance that a fresh mount shows no checkpoints and no journal at first
    skew_s: float = 0.0  # the VMs' clocks differ from true time by up to this (each its own offset)
    clock_steps: list = field(default_factory=list)  # (t, seconds): a live VM's clock is set back
    deterministic: bool = True
    quota: int | None = None
    heartbeat_s: float = 30.0
    min_gap_s: float = 1.0
    retry_s: float = 60.0

    @property
    def attrs(self) -> bool:
        return self.mode in ("attrs", "api")

    @property
    def api(self) -> bool:
        return self.mode.startswith("api")

    @property
    def fstype(self) -> str:
        return "fuse.rclone" if self.mode == "other" else "fuse.drive"

    @property
    def upload_factor(self) -> float:
        """How long a checkpoint takes to upload, in save intervals."""
        return self.size * 4 / 3 / self.rate / self.interval_s

    def describe(self) -> str:
        return (f"seed {self.seed}: {self.mode}, {self.duration / HOUR:.1f} h, a save every {self.interval_s:.0f} s, "
                f"uploads take {self.upload_factor:.2f} intervals, keep={self.keep}, "
                f"{len(self.disconnects)} disconnect(s), {len(self.restarts)} restart(s), "
                f"{len(self.takeovers)} second runtime(s), {len(self.hides)} hidden file(s), "
                f"{len(self.outages)} errno-107 window(s), faults {self.faults}; double saves {self.double_save:.0%}, "
                f"{'first upload recycled, ' if self.recycle_first else ''}busy at open {self.busy_at_open:.0%}, "
                f"clocks off by up to {self.skew_s:.0f} s, {len(self.clock_steps)} clock(s) set back")


def make_schedule(seed: int, long_share: float = 0.02) -> Schedule:
    rng = random.Random(seed)
    mode = rng.choices(list(MODES), weights=list(MODES.values()))[0]
    long = rng.random() < long_share
    interval = rng.uniform(1200, 2400) if long else rng.uniform(60, 300)
    duration = 12 * HOUR if long else interval * rng.uniform(2, 8)  # a few saves: the cost is per save
    size = rng.randrange(3000, 12000)
    factor = math.exp(rng.uniform(math.log(0.05), math.log(10.0)))  # 1/20 to 10 intervals per upload
    rate = size * 4 / 3 / (interval * factor)
    pace = size * 4 / 3 / (interval * rng.uniform(0.2, 2.0))
    settle = rng.choice((300.0, 600.0))
    if mode in ("none", "other") and not long:
        # Where nothing confirms uploads, what a settle age has to do with the upload time matters (issue 27,
        # finding 3): settle ages shorter than an upload, in runs long enough for a few uploads to land.
        upload_s = interval * factor
        settle = upload_s * rng.uniform(0.3, 1.2)
        duration = max(duration, min(upload_s * rng.uniform(2, 4), interval * 16))
    faults = FaultRates(eio=rng.choice((0.0, 0.01, 0.03)), short=rng.choice((0.0, 0.02, 0.05)),
                        torn=rng.choice((0.0, 0.0, 0.01)), stall=rng.choice((0.0, 0.005)),
                        stall_s=rng.uniform(1, 10), write_eio=rng.choice((0.0, 0.01)))

    def times(n):
        return sorted(rng.uniform(0.05, 0.98) * duration for _ in range(n))

    schedule = Schedule(
        seed=seed, mode=mode, duration=duration, interval_s=interval, size=size, rate=rate, pace_bps=pace,
        keep=rng.choice((1, 1, 2, 3)), settle_s=settle, faults=faults,
        hides=[(t, rng.uniform(0.2, 4.0)) for t in times(rng.randrange(0, int(duration / interval) + 2))],
        outages=[(t, rng.uniform(5, 60)) for t in times(rng.choice((0, 0, 1, 2)))],
        disconnects=times(rng.choice((0, 1, 1, 2, 3, 4))),
        restarts=times(rng.choice((0, 0, 1))),
        takeovers=[(t, rng.random() < 0.5) for t in times(rng.choice((0, 0, 0, 1)))],
        deterministic=rng.random() < 0.8, hide_at_open=rng.choice((0.0, 0.3, 0.6)),
        heartbeat_s=rng.choice((30.0, 60.0, 120.0, 120.0)), retry_s=interval,
        # The workers are called when they ask, or later (threads are late): a few times a save interval.
        min_gap_s=interval / 4)
    if schedule.api:
        schedule.api_fail = rng.choice((0.0, 0.05, 0.2))
        schedule.api_outages = [(t, rng.uniform(30, 600)) for t in times(rng.choice((0, 0, 1, 2)))]
    # Issue 38's fault kinds, drawn last (the draws above replay the schedules of before).
    schedule.double_save = rng.choice((0.0, 0.0, 0.3, 0.7))
    schedule.recycle_first = rng.random() < 0.25
    schedule.busy_at_open = rng.choice((0.0, 0.0, 0.5))
    skew = rng.uniform(60, 900)
    schedule.skew_s = rng.choice((0.0, 0.0, skew))
    schedule.clock_steps = [(t, rng.uniform(30, 600)) for t in times(rng.choice((0, 0, 1)))]
    return schedule
