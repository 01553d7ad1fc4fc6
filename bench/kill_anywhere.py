"""Kill a training job at many random moments; every restart must resume from a valid checkpoint.

    python bench/kill_anywhere.py [--moments 24] [--loop trainer|plain] [--seed 0]

Each moment is a SIGKILL either at a random point of a random phase (mid-step, mid local
save, mid upload, mid manifest write, mid prune, mid journal append, mid resume-copy) or from
outside after a random delay. Half the restarts also wipe local disk (a new Colab VM). Checks:
no restart crashes, each resumes from a checkpoint at most one save interval behind the last
save, and the final weights equal an uninterrupted run's.
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
            pending_before = None
        else:  # killed while fetching its checkpoint, before it started: the next start is checked
            resumed, check = "-", "later"
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
                     check, "new VM" if wipe else "same VM"))
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
    return 0 if final_ok and crashes == 0 and violations == 0 and diff is not None and diff <= 1e-6 else 1


if __name__ == "__main__":
    sys.exit(main())
