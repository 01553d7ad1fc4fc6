"""Run the kit's durability core over many seeded, faulty Drives, and shrink what fails.

    python tests/sim/simulate.py --seeds 10000 [--first 0] [--long-share 0.1]
    python tests/sim/simulate.py --seed 1234 --trace          # one schedule, its trace
    python tests/sim/simulate.py --seeds 1000 --hub           # the run kept on the Hugging Face Hub instead

Each seed makes one schedule (`schedule.py`) and runs it to its end (`world.py`), checking the
invariants (`invariants.py`) after every event. A failing seed is printed with its schedule, shrunk
(events and faults taken away while it still fails) and the last lines of its trace.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import logging
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
for extra in (HERE, HERE.parent / "scripts"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from old_rules import OLD_RULES, patched  # noqa: E402
from schedule import Schedule, make_schedule  # noqa: E402
from world import World  # noqa: E402

__all__ = ["Outcome", "run_schedule", "run_seeds", "shrink", "report"]


@dataclasses.dataclass
class Outcome:
    schedule: Schedule
    violations: list
    trace: list
    seconds: float
    starts: int = 0
    resumes: int = 0
    refusals: int = 0
    happened: dict = dataclasses.field(default_factory=dict)  # the fault kinds met, counted
    world: type = World  # the Drive world, or the Hub's (`hubworld.HubWorld`)


def run_schedule(schedule: Schedule, world: type = World) -> Outcome:
    logging.disable(logging.CRITICAL)  # the kit's log lines are the trace's business here
    try:
        started = time.perf_counter()
        made = world(schedule)
        violations = made.run()
        return Outcome(schedule, violations, list(made.trace), time.perf_counter() - started,
                       made.starts, made.resumes, made.refusals, dict(made.happened), world)
    finally:
        logging.disable(logging.NOTSET)


def run_seeds(seeds, long_share: float = 0.02, stop_at_first: bool = False,
              world: type = World) -> tuple[list[Outcome], dict]:
    """Every seed's outcome that failed, and totals."""
    failed, totals = [], {"schedules": 0, "seconds": 0.0, "virtual_hours": 0.0, "starts": 0, "resumes": 0,
                          "refusals": 0, "long": 0, "modes": {}, "happened": {}}
    for seed in seeds:
        outcome = run_schedule(make_schedule(seed, long_share), world)
        totals["schedules"] += 1
        totals["seconds"] += outcome.seconds
        totals["virtual_hours"] += outcome.schedule.duration / 3600
        totals["long"] += outcome.schedule.duration >= 12 * 3600
        totals["modes"][outcome.schedule.mode] = totals["modes"].get(outcome.schedule.mode, 0) + 1
        for key in ("starts", "resumes", "refusals"):
            totals[key] += getattr(outcome, key)
        for kind, count in outcome.happened.items():
            totals["happened"][kind] = totals["happened"].get(kind, 0) + count
        if outcome.violations:
            failed.append(outcome)
            if stop_at_first:
                break
    return failed, totals


def shrink(schedule: Schedule, budget: int = 60, world: type = World) -> Schedule:
    """A smaller schedule that still fails: events and faults taken away one at a time."""
    best = schedule
    tries = 0
    changed = True
    while changed and tries < budget:
        changed = False
        for name in ("takeovers", "restarts", "disconnects", "outages", "api_outages", "hides", "clock_steps"):
            items = getattr(best, name)
            for i in range(len(items)):
                candidate = copy.deepcopy(best)
                setattr(candidate, name, items[:i] + items[i + 1:])
                tries += 1
                if run_schedule(candidate, world).violations:
                    best, changed = candidate, True
                    break
        for rate in ("eio", "short", "torn", "stall", "write_eio"):
            if getattr(best.faults, rate):
                candidate = copy.deepcopy(best)
                setattr(candidate.faults, rate, 0.0)
                tries += 1
                if run_schedule(candidate, world).violations:
                    best, changed = candidate, True
        for name, none in (("api_fail", 0.0), ("double_save", 0.0), ("recycle_first", False), ("busy_at_open", 0.0),
                           ("skew_s", 0.0)):
            if getattr(best, name):
                candidate = copy.deepcopy(best)
                setattr(candidate, name, none)
                tries += 1
                if run_schedule(candidate, world).violations:
                    best, changed = candidate, True
    return best


def report(outcome: Outcome, shrunk: bool = True, lines: int = 30) -> str:
    schedule = outcome.schedule
    text = [f"VIOLATION, {schedule.describe()}", *("  " + v for v in outcome.violations[:3])]
    trace = outcome.trace
    if shrunk:
        small = shrink(schedule, world=outcome.world)
        again = run_schedule(small, outcome.world)
        if again.violations:
            text.append("shrunk to: " + small.describe())
            trace = again.trace
    text += ["trace (virtual seconds, the last lines):", *("  " + line for line in trace[-lines:])]
    return "\n".join(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=1000)
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None, help="run this one seed and print its trace")
    parser.add_argument("--long-share", type=float, default=0.02)
    parser.add_argument("--trace", action="store_true")
    parser.add_argument("--hub", action="store_true", help="the run kept on the Hugging Face Hub (hubworld.py)")
    from hub_rules import HUB_RULES

    parser.add_argument("--old-rule", choices=sorted(OLD_RULES) + sorted(HUB_RULES), default=None,
                        help="put back one of f65fb4d's rules (old_rules.py) and find the first seed it fails")
    args = parser.parse_args()
    world = World
    if args.hub:
        from hubworld import HubWorld as world
    if args.old_rule is not None:
        with patched(args.old_rule, HUB_RULES if args.old_rule in HUB_RULES else None):
            failed, totals = run_seeds(range(args.first, args.first + args.seeds), args.long_share, stop_at_first=True,
                                       world=world)
            print(f"old rule {args.old_rule}: {totals['schedules']} schedules to the first violation"
                  if failed else f"old rule {args.old_rule}: no violation in {totals['schedules']} schedules")
            for outcome in failed:
                print(report(outcome))
        return 0 if failed else 1
    if args.seed is not None:
        outcome = run_schedule(make_schedule(args.seed, args.long_share), world)
        print(outcome.schedule.describe())
        print("\n".join(outcome.trace if args.trace else outcome.trace[-30:]))
        print(f"{len(outcome.violations)} violation(s) in {outcome.seconds:.3f} s: {outcome.violations[:3]}")
        return 1 if outcome.violations else 0
    failed, totals = run_seeds(range(args.first, args.first + args.seeds), args.long_share, world=world)
    print(f"{totals['schedules']} schedules ({totals['long']} of 12 h; {totals['virtual_hours']:.0f} virtual hours, "
          f"{totals['starts']} starts, {totals['resumes']} resumes, {totals['refusals']} refusals; "
          + ", ".join(f"{n} {kind}" for kind, n in sorted(totals["happened"].items()))
          + f") in {totals['seconds']:.1f} s: {len(failed)} with a violation")
    for outcome in failed[:3]:
        print(report(outcome))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
