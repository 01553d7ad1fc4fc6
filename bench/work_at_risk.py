"""Work at risk on an emulated Google Drive: the pruning rule before 0.2 vs "in the cloud" first, on a
Drive that reports uploads, one that does not, and one that errs and stalls.

    python bench/work_at_risk.py [--minutes 10] [--rates 2e6 20e6] [--save-every 20s] [--vocab 160000]
                                 [--rows written cloud unconfirmed faulty] [--settle 10min]
                                 [--figure PATH | --no-figure]

Work at risk is the training a disconnect would cost right now: the seconds since the newest
checkpoint *in the cloud* was saved (since the start while there is none). Each configuration
trains the tiny BERT of the tests through `start_run` + `run.train` (checkpoints of ~60 MB with
the default `--vocab`, a time-based `save_every`) against the DriveFS emulator at one upload rate,
under one rule; all run side by side in one go, and once a second this script reads the
emulator's cloud folder (the ground truth, not the kit's claims) for the newest checkpoint whose
manifest and file sizes hold. Needs FUSE (Debian fuse3, mfusepy). The figure draws the same samples: the
work at risk over the run's time, a panel per upload rate, a line per rule (`docs/figures/work_at_risk.png`).

Rows: `written`, the rule before 0.2; `cloud`, the kit on a mount with DriveFS's attributes;
`unconfirmed`, the kit on a mount without them, which guesses no upload rate (issue 27): it keeps the
run's oldest checkpoint, every one younger than `--settle`, and one per doubling of age beyond it. Run
it at rates below the 1 MB/s that the settle rule of 0.3 assumed, for at least 3 of its settle ages
(`--settle` plus the size at 1 MB/s); `faulty`, the kit on a mount with attributes that fails 1 % of
reads with EIO, hides an entry from 2 % of listings, holds 0.5 % of all operations for 3 s and fails
0.2 % with errno 107. "Drive peak" is what the mount held at most (checkpoints, bytes), read from the
emulator's cache.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "scripts"))
import figures  # noqa: E402
import harness  # noqa: E402
from emulated_drive import EmulatedDrive, why_no_fuse  # noqa: E402

from colab_kit.checkpoints import validity  # noqa: E402
from colab_kit.checkpoints.checkpoint import list_checkpoints  # noqa: E402
from colab_kit.checkpoints.journal import read_events  # noqa: E402

RULES = {"written": "prune once a newer one is written (before 0.2)",
         "cloud": "prune once a newer one is in the cloud",
         "unconfirmed": "no attributes: the ladder (no rate guessed)",
         "faulty": "in the cloud, on a Drive that errs and stalls"}
FAULTS = "eio=0.01,vanish=0.02,stall=0.005:3,enotconn=0.002"


def newest_in_cloud(drive: EmulatedDrive, name: str) -> float | None:
    """When the newest checkpoint in the cloud folder that holds together was saved (None: none)."""
    for step, path in list_checkpoints(drive.cloud / name / "checkpoints"):
        verdict = validity.check(path, step=step)  # sizes and sha256 (cached while the files stay the same)
        if verdict.valid:
            return verdict.manifest.created
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--rates", type=float, nargs="+", default=[2e6, 20e6], help="upload bytes/s")
    parser.add_argument("--save-every", default="20s")
    parser.add_argument("--vocab", type=int, default=160_000, help="160000: ~60 MB checkpoints")
    parser.add_argument("--step-sleep", type=float, default=0.1)
    parser.add_argument("--rows", nargs="+", default=list(RULES), choices=list(RULES))
    parser.add_argument("--settle", default="10min", help="start_run(settle=): where the ladder's doubling begins")
    figures.add_arguments(parser, "work_at_risk")
    args = parser.parse_args()
    if reason := why_no_fuse():
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="work_at_risk-"))
    configs = []
    for rate in args.rates:
        for rule in args.rows:
            where = root / f"{rate:.0e}-{rule}"
            drive = EmulatedDrive(where / "gdrive", rate=rate, attrs=rule != "unconfirmed",
                                  faults=FAULTS if rule == "faulty" else "", seed=int(rate)).mount()
            job = harness.Job(where, steps=10**6, save_every=args.save_every, step_sleep=args.step_sleep,
                              drive_root=drive.mountpoint, name="run",
                              extra=["--vocab", args.vocab, "--settle", args.settle,
                                     "--prune-after", "written" if rule == "written" else "cloud"])
            configs.append({"rate": rate, "rule": rule, "drive": drive, "job": job, "proc": job.start(),
                            "risk": [], "empty_after_first": 0, "peak": (0, 0)})
    print(f"{len(configs)} runs side by side for {args.minutes:g} min in {root} ...", flush=True)
    started = time.time()
    deadline = time.monotonic() + args.minutes * 60
    while time.monotonic() < deadline:
        now = time.time()
        for c in configs:
            events = c["job"].local_events() if not c["risk"] else None
            if events is not None and not any(e["event"] == "start" for e in events):
                continue  # still importing: training has not begun
            c.setdefault("began", now)
            saved = newest_in_cloud(c["drive"], "run")
            if saved is None and c.get("seen"):
                c["empty_after_first"] += 1
            c["seen"] = c.get("seen") or saved is not None
            c["risk"].append(now - (saved if saved is not None else c["began"]))
            c.setdefault("at", []).append(now - c["began"])
            c["peak"] = max(c["peak"], held_on_drive(c["drive"], "run"))
        time.sleep(max(0.0, 1.0 - (time.time() - now)))
    for c in configs:
        c["proc"].kill()
        c["proc"].communicate()
        c["drive"].unmount()

    print(f"\nwork at risk over {args.minutes:g} min of training, save_every={args.save_every!r}, "
          f"checkpoints of ~{checkpoint_mb(configs):.0f} MB, sampled once a second from the cloud folder:")
    print(f"{'upload':>10}  {'rule':<47} {'median s':>9} {'max s':>8} {'no ckpt s':>10} {'in cloud':>9} "
          f"{'interval s':>11} {'Drive peak':>16}")
    for c in configs:
        events = c["job"].local_events()
        stretched = [e["interval_s"] for e in events if e["event"] == "warn" and e.get("what") == "save_interval"]
        cloud = len([e for e in events if e["event"] == "cloud" and "step" in e])
        risk = c["risk"] or [float("nan")]
        peak = f"{c['peak'][0]} / {c['peak'][1] / 1e6:.0f} MB"
        print(f"{c['rate'] / 1e6:>5.3g} MB/s  {RULES[c['rule']]:<47} {statistics.median(risk):>9.0f} {max(risk):>8.0f} "
              f"{c['empty_after_first']:>10d} {cloud:>9d} {stretched[-1] if stretched else '-':>11} {peak:>16}")
        if c["rule"] == "faulty":
            kinds: dict[str, int] = {}
            for fault in c["drive"].faults_seen():
                kinds[fault["fault"]] = kinds.get(fault["fault"], 0) + 1
            print(f"{'':>12}faults injected: {', '.join(f'{k} x{n}' for k, n in sorted(kinds.items()))}")
    print("\n'no ckpt s': seconds, after the first checkpoint reached the cloud, with none there that holds "
          "together; 'in cloud': checkpoints confirmed (cloud events); 'interval s': the stretched save interval.")
    print(f"(elapsed {time.time() - started:.0f} s)")
    draw(configs, args)
    return 0


def draw(configs: list[dict], args) -> None:
    """The samples the table summarises: work at risk over the run's time, a panel per upload rate."""
    rates = sorted({c["rate"] for c in configs}, reverse=True)
    fig, axes = figures.figure(4.2 * len(rates), 3.6, ncols=len(rates), sharey=True, squeeze=False)
    colours = {"written": "tab:red", "cloud": "tab:blue", "unconfirmed": "tab:green", "faulty": "tab:orange"}
    for ax, rate in zip(axes[0], rates):
        for c in (c for c in configs if c["rate"] == rate and c["risk"]):
            ax.plot(c["at"], c["risk"], color=colours[c["rule"]], lw=1.2, label=RULES[c["rule"]])
        ax.plot([0, args.minutes * 60], [0, args.minutes * 60], color="0.75", lw=0.8, ls=":",
                label="nothing in the cloud since the start")
        ax.set_title(f"Drive uploading {rate / 1e6:g} MB/s", fontsize=9)
        ax.set_xlabel("training time, s")
        ax.set_xlim(0, args.minutes * 60)
        ax.set_ylim(bottom=0)
    axes[0][0].set_ylabel("work a disconnect would cost now, s")
    axes[0][-1].legend(fontsize=7, loc="upper left", frameon=False)
    fig.suptitle(f"Work at risk, sampled once a second from the cloud folder (save_every={args.save_every!r}, "
                 f"checkpoints of ~{checkpoint_mb(configs):.0f} MB)", fontsize=9)
    figures.save(fig, args)


def held_on_drive(drive: EmulatedDrive, name: str) -> tuple[int, int]:
    """(checkpoint folders, bytes) the mount holds now, read from the emulator's cache (the VM's side)."""
    folders = list_checkpoints(drive.cache / name / "checkpoints")
    held = 0
    for _, folder in folders:
        for path in folder.rglob("*"):
            try:
                held += path.stat().st_size if path.is_file() else 0
            except OSError:
                pass
    return len(folders), held


def checkpoint_mb(configs) -> float:
    sizes = [e["bytes"] for c in configs for e in read_events(c["job"].local / "events.jsonl") if e["event"] == "sync"]
    return statistics.median(sizes) / 1e6 if sizes else float("nan")


if __name__ == "__main__":
    raise SystemExit(main())
