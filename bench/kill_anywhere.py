"""Kill a training job at many random moments; every restart must resume from a valid checkpoint.

    python bench/kill_anywhere.py [--moments 24] [--loop trainer|plain] [--seed 0] [--figure PATH | --no-figure]

Each moment is a SIGKILL either at a random point of a random phase (mid-step, mid local
save, mid upload, mid manifest write, mid prune, mid journal append, mid resume-copy) or from
outside after a random delay. Half the restarts also wipe local disk (a new Colab VM). Checks:
no restart crashes, each resumes from a checkpoint at most one save interval behind the last
save, and the final weights equal an uninterrupted run's. The figure draws the table's rows: each kill moment's
phase, the step its run resumed from, and the last save before it with one save interval below it.
"""

from __future__ import annotations

import argparse
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "scripts"))
import figures  # noqa: E402
import harness  # noqa: E402

# Upper bounds of K per phase, small enough that most runs reach their moment before the end.
PHASE_RANGE = {"step": 50, "local_save": 5, "upload": 20, "manifest": 5, "prune": 4, "journal": 15,
               "fetch": 3}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--moments", type=int, default=24)
    parser.add_argument("--loop", choices=["trainer", "plain"], default="trainer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=100)
    figures.add_arguments(parser, "kill_anywhere")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="kill_anywhere-"))
    started = time.monotonic()
    reference = harness.reference_weights(root / "reference", args.loop, steps=args.steps)
    job = harness.Job(root / "job", loop=args.loop, steps=args.steps, step_sleep=0.02)
    job.root.mkdir(parents=True)
    rows, crashes, violations, completed_runs = [], 0, 0, 0
    moments = 0
    pending_before = None  # last save before a kill whose restart has not been checked yet
    while moments < args.moments:
        before = harness.last_saved_step(job)
        if pending_before is None:
            pending_before = before
        if rng.random() < 0.2:
            delay = rng.uniform(2.0, 6.0)
            what = f"outside after {delay:.1f}s"
            code, text = job.run_and_kill_after(delay)
        else:
            phase = rng.choice(list(PHASE_RANGE))
            what = f"{phase}:{rng.randint(1, PHASE_RANGE[phase])}"
            code, text = job.run(what)
        if code not in (0, -signal.SIGKILL):
            crashes += 1
            print(text[-3000:])
        resumed = harness.resumed_from(text)
        if resumed is not None:  # killed after it started: check where it resumed from
            check = "ok" if resumed >= pending_before - job.save_every else "LOST >1 INTERVAL"
            violations += check != "ok"
            checked_from = pending_before  # the last save the check measured from
            pending_before = None
        else:  # killed while fetching its checkpoint, before it started: the next start is checked
            resumed, check, checked_from = "-", "later", None
        if code == 0:
            # The chosen moment did not come before the end: start the job over from nothing.
            completed_runs += 1
            shutil.rmtree(job.root)
            job.root.mkdir(parents=True)
            pending_before = None
            continue
        moments += 1
        wipe = rng.random() < 0.5
        rows.append((moments, what, "killed" if code == -signal.SIGKILL else f"exit {code}", before, resumed,
                     check, "new VM" if wipe else "same VM", checked_from))  # checked_from: drawn, not printed
        if wipe:
            job.new_vm()
    code, text = job.run()
    final_ok = code == 0
    diff = harness.max_abs_diff(reference, harness.load_weights(job.root / "final.safetensors")) if final_ok else None

    print(f"{'#':>3}  {'kill moment':<22} {'result':<8} {'saved before':>12} {'resumed from':>12}  check  then")
    for row in rows:
        print(f"{row[0]:>3}  {row[1]:<22} {row[2]:<8} {row[3]:>12} {row[4]:>12}  {row[5]:<5}  {row[6]}")
    print(f"\nloop={args.loop} moments={len(rows)} crashes={crashes} resume_violations={violations} "
          f"(runs that finished before their moment, restarted fresh: {completed_runs})")
    print(f"final run: {'completed' if final_ok else 'FAILED'}; max |w - w_uninterrupted| = {diff}")
    print(f"wall time {time.monotonic() - started:.0f} s")
    draw(args, rows, job.save_every, crashes, violations, diff)
    return 0 if final_ok and crashes == 0 and violations == 0 and diff is not None and diff <= 1e-6 else 1


def draw(args, rows, save_every: int, crashes: int, violations: int, diff) -> None:
    """Row by row as the table has them: each run's kill moment, the step it resumed from at its start (a dot in the
    kill's colour) and the last save before it with one save interval below it (the check: at or above the bottom).
    "then" is what followed the kill (the next run's VM), marked on the moment's label."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    fig, ax = figures.figure(8.5, 4.0)
    phases = [*PHASE_RANGE, "outside"]
    colours = dict(zip(phases, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown",
                                "tab:pink", "tab:gray")))
    for number, what, _, before, resumed, _, _, checked in rows:
        colour = colours[what.split(":")[0].split(" ")[0]]
        if checked is None:  # killed while fetching, before it started: the next restart is the one checked
            ax.scatter(number, before, marker="x", color=colour, zorder=3)
            continue
        # `checked`: the last save the check measures from (before, or an earlier unchecked one)
        ax.bar(number, min(save_every, checked), bottom=max(checked - save_every, 0), width=0.6, color="0.9",
               edgecolor="0.6")
        ax.scatter(number, resumed, color=colour, s=28, zorder=3)
    legend = [Patch(facecolor="0.9", edgecolor="0.6", label=f"the last save and one save interval\n({save_every} "
                    "steps) below it: ok at or above"),
              Line2D([], [], marker="o", color="0.3", linestyle="", label="resumed from, at the run's start"),
              Line2D([], [], marker="x", color="0.3", linestyle="",
                     label="killed before it started\n(checked at the next start)"),
              *(Patch(color=colours[phase], label=f"killed at: {phase}") for phase in phases)]
    ax.set_xticks([row[0] for row in rows], [row[1].replace("outside after ", "out ") + (" *" if row[6] == "new VM"
                                                                                         else "") for row in rows],
                  rotation=60, ha="right", fontsize=7)
    ax.set_xlim(0.3, len(rows) + 0.7)
    ax.set_ylim(-2, args.steps + 2)
    ax.set_xlabel("kill moment, in the table's order (*: then a new VM, local disk wiped)", fontsize=8)
    ax.set_ylabel("training step")
    ax.legend(handles=legend, fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    ax.set_title(f"SIGKILL at {len(rows)} moments (loop={args.loop}): {crashes} crashes, {violations} restarts over "
                 f"one interval behind;\nthe final weights against an uninterrupted run's: max |difference| = {diff}",
                 fontsize=10)
    figures.save(fig, args)


if __name__ == "__main__":
    sys.exit(main())
